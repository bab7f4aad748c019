"""Speculative decoding through vLLM's real scheduler and KV-cache manager (issue 14): every
decoding request gets 1-3 draft tokens per step and a random number of them is accepted, so
the running position jumps by 1 to 4 tokens, back over rejected ones, and across block
boundaries inside a step.

What is checked on every step: the pool's reference counts, the lighter layout (the running
state block and its speculative blocks allocated, few blocks resident), and at the end every
block returned and the outputs equal to a replay without speculation (the mocked model samples
the same tokens either way) and to align's under the same speculation. The shadow worker
(``shadow.py``) applies the kernels' column rules and the runner's settle and checks every
state read and every hashed block's contents. Multi-turn sessions check that the boundaries
crossed inside accepted drafts are cached: a follow-up turn hits its previous turn's deepest
boundary, as without drafting.
"""

from __future__ import annotations

import random

import pytest

from vllm_lighter_mamba.bench.sim import SimRequest, Speculation, replay
from vllm_lighter_mamba.v1.core.single_type_kv_cache_manager import LighterMambaManager, running_position

from .invariants import check_all_returned, check_pool
from .shadow import replay_with_shadow


def layout(num_spec: int, block_size: int):
    def check(scheduler, output, step):
        check_pool(scheduler)
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers[1:]:
            assert isinstance(manager, LighterMambaManager)
            for rid, blocks in manager.req_to_blocks.items():
                live = [i for i, b in enumerate(blocks) if not b.is_null]
                assert len(live) <= 2 + num_spec, (rid, live)
                if rid in output.num_scheduled_tokens:
                    first = running_position(scheduler.requests[rid].num_computed_tokens, block_size)
                    assert all(not blocks[p].is_null for p in range(first, first + 1 + num_spec)), (rid, live)

    return check


def random_trace(seed: int) -> tuple[list[SimRequest], dict]:
    """Prompts sharing system prompts, some exact repeats, decode long enough to cross blocks."""
    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])
    systems = [[rng.randrange(1, 300) for _ in range(rng.randrange(bs, 5 * bs))] for _ in range(2)]
    reqs: list[SimRequest] = []
    for i in range(rng.randrange(3, 9)):
        if reqs and rng.random() < 0.25:
            prompt = list(rng.choice(reqs).prompt_token_ids)
        else:
            prompt = rng.choice(systems) + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 3 * bs))]
        reqs.append(SimRequest(f"q{i}", prompt, rng.randrange(1, 5 * bs), rng.randrange(0, 10 * (i + 1))))
    kwargs = {
        "block_size": bs,
        "max_num_batched_tokens": bs * rng.randrange(2, 6),
        "max_num_seqs": rng.choice([1, 2, 4]),
        "num_mamba_groups": rng.choice([1, 3]),
        "num_blocks": rng.choice([60, 400]),
        "max_model_len": 4096,
    }
    return reqs, kwargs


@pytest.mark.parametrize("seed", range(40))
def test_random_acceptance_keeps_the_layout_and_the_outputs(qwen3_next_dir, seed):
    reqs, kwargs = random_trace(seed)
    num_spec = 1 + seed % 3
    speculation = Speculation(num_spec, seed=seed)
    plain = replay("lighter", reqs, qwen3_next_dir, max_steps=20_000, **kwargs)
    drafts: list[int] = []
    ours = replay_with_shadow(
        reqs, qwen3_next_dir, max_steps=20_000, speculation=speculation,
        num_speculative_blocks=num_spec, check=layout(num_spec, kwargs["block_size"]),
        observers=[lambda output, _: drafts.extend(map(len, output.scheduled_spec_decode_tokens.values()))],
        **kwargs,
    )
    check_all_returned(ours.scheduler)
    # The worker's side, on the shadow: every state read was the reader's exact state, and
    # every hashed block held its boundary's state once the step's accepted states moved.
    assert ours.shadow.num_settle_moves > 0 and ours.shadow.num_hashed_checked > 0
    assert ours.outputs == plain.outputs
    align = replay(
        "align", reqs, qwen3_next_dir, max_steps=20_000, speculation=speculation,
        num_speculative_blocks=num_spec, **kwargs,
    )
    assert ours.outputs == align.outputs
    # Drafts were scheduled, num_spec per decoding request and step (fewer only near
    # max_model_len or the token budget).
    assert drafts and max(drafts) == num_spec


def test_speculation_is_replayed_synchronously_only(qwen3_next_dir):
    with pytest.raises(ValueError, match="synchronous"):
        replay("lighter", [SimRequest("a", [1, 2, 3], 2)], qwen3_next_dir, overlap=True,
               speculation=Speculation(2), async_scheduling=True)


def sessions(seed: int, block_size: int):
    """Three-turn sessions: a turn's prompt is the previous turn's prompt and output plus a few
    new tokens, so a follow-up's hit is a boundary its previous turn crossed while decoding.
    Returns the first turns, vLLM's ``on_finish`` hook, and the hit each follow-up can have:
    the deepest boundary within both its prompt (less the token vLLM recomputes) and the
    tokens its previous turn computed."""
    rng = random.Random(seed)
    bs = block_size
    first = [
        SimRequest(f"s{i}-0", [rng.randrange(1, 300) for _ in range(rng.randrange(bs, 4 * bs))],
                   rng.randrange(bs, 4 * bs), arrival_step=i)
        for i in range(4)
    ]
    deepest: dict[str, int] = {}

    def on_finish(request, step: int) -> list[SimRequest]:
        session, turn = request.request_id.rsplit("-", 1)
        if int(turn) == 2:
            return []
        own = random.Random(f"{seed}-{request.request_id}")  # the same follow-up in every mode
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        prompt = tokens + [own.randrange(1, 300) for _ in range(own.randrange(1, 2 * bs))]
        follow = SimRequest(
            f"{session}-{int(turn) + 1}", prompt, own.randrange(bs, 4 * bs), arrival_step=step + 1
        )
        # (A last step's accepted drafts can run past the stop: computed may reach the end.)
        computed = min(request.num_computed_tokens, len(tokens))
        deepest[follow.request_id] = min(len(prompt) - 1, computed) // bs * bs
        return [follow]

    return first, on_finish, deepest


def session_replay_args(num_spec: int, block_size: int) -> dict:
    """The replay settings of the session tests: a small budget, room for every state."""
    bs = block_size
    return {"block_size": bs, "max_num_batched_tokens": 4 * bs, "max_num_seqs": 4, "num_blocks": 400,
            "max_model_len": 4096, "num_speculative_blocks": num_spec, "max_steps": 20_000}


@pytest.mark.parametrize("seed", range(6))
def test_boundaries_crossed_inside_accepted_drafts_are_hit(qwen3_next_dir, seed):
    """Every follow-up turn hits its previous turn's deepest boundary with drafting on (the
    block of a boundary crossed inside a step's accepted drafts is kept, filled by the settle
    and hashed once the step's output is in), each hit read by the shadow worker as exactly
    its prefix's state; align under the same drafting hits no more."""
    num_spec, bs = 1 + seed % 3, 8
    kwargs = session_replay_args(num_spec, bs)
    first, on_finish, deepest = sessions(seed, bs)
    ours = replay_with_shadow(first, qwen3_next_dir, on_finish=on_finish,
                              speculation=Speculation(num_spec, seed=seed), **kwargs)
    check_all_returned(ours.scheduler)
    assert len(deepest) == 8 and ours.shadow.num_settle_moves > 0
    assert {rid: ours.cached_per_request[rid] for rid in deepest} == deepest
    first, on_finish, _ = sessions(seed, bs)
    align = replay("align", first, qwen3_next_dir, on_finish=on_finish,
                   speculation=Speculation(num_spec, seed=seed), **kwargs)
    assert all(ours.cached_per_request[rid] >= align.cached_per_request[rid] for rid in deepest)


@pytest.mark.parametrize("seed", range(6))
def test_align_hits_drafted_boundaries_when_hashed_after_each_output(qwen3_next_dir, seed):
    """Align under the same drafting, hashed after every output as vLLM's async scheduler
    does (``hash_after_output``, the replay being synchronous): every follow-up hits its
    previous turn's deepest boundary too. Without it the synchronous scheduler frees such a
    block before hashing it, which is all that separates align from the lighter cache in the
    replay's drafting figures (docs/benchmarks.md). With align keeping every state it
    hashes (``retention_interval=None``); under vLLM's default sparse retention (0) a state a
    decode crosses is not kept and the follow-ups hit less."""
    num_spec, bs = 1 + seed % 3, 8
    kwargs = session_replay_args(num_spec, bs)
    first, on_finish, deepest = sessions(seed, bs)
    align = replay("align", first, qwen3_next_dir, on_finish=on_finish, hash_after_output=True,
                   retention_interval=None,
                   speculation=Speculation(num_spec, seed=seed), **kwargs)
    check_all_returned(align.scheduler)
    assert len(deepest) == 8
    assert {rid: align.cached_per_request[rid] for rid in deepest} == deepest
