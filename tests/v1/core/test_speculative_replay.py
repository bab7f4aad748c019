"""Speculative decoding through vLLM's real scheduler and KV-cache manager (issue 14, the
scheduler's half): every decoding request gets 1-3 draft tokens per step and a random number
of them is accepted, so the running position jumps by 1 to 4 tokens, back over rejected ones,
and across block boundaries inside a step.

What is checked on every step: the pool's reference counts, the lighter layout (the running
state block and its speculative blocks allocated, few blocks resident), and at the end every
block returned and the outputs equal to a replay without speculation (the mocked model samples
the same tokens either way) and to align's under the same speculation. What the worker does
with the speculative columns (the accepted-token state copy) is not modelled here: the lighter
cache still rejects speculative decoding at start-up.
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
