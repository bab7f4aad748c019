"""The lighter cache against vLLM's align mode over random traces (system prompts, exact
repeats, multi-turn continuations) at pool sizes from the smallest that runs every request to
one that never evicts.

What holds on every trace and pool size: every state read is the right one (shadow worker),
the pool's invariants and the retention policy's bookkeeping hold after every step, outputs
are align's, and without memory pressure the lighter cache never gets fewer hit tokens.

What does not: "never fewer hit tokens than align under pressure". On 200 of these traces x 6
pool sizes the lighter cache was below align in 14.2% of the cases with evictions with the
retention policy and 9.4% with vLLM's LRU order (2026-12-01): it caches more states than align
(cold-prompt checkpoints, junction stops), which in a nearly full pool push out a state align
keeps, and no eviction order can beat LRU on every trace. Summed over the traces it gets more
hit tokens than align at every pool size (test below; 1.08x with the policy, 1.05x without);
a known counterexample per mode is kept as a strict xfail.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_lighter_mamba.bench.sim import SimRequest, continuation, replay

from .invariants import check_all_returned, check_pool
from .shadow import replay_with_shadow


def random_trace(seed: int) -> tuple[list[SimRequest], dict, list[int]]:
    """System prompts shared by questions, exact repeats and multi-turn continuations (an
    earlier prompt, its reply and a new message), with random arrivals; and pool sizes from
    the smallest that runs every request to one that never evicts."""
    rng = random.Random(seed)
    bs = rng.choice([4, 8, 16])
    systems = [
        [rng.randrange(1, 300) for _ in range(rng.randrange(bs, 6 * bs))] for _ in range(rng.randrange(1, 4))
    ]
    reqs: list[SimRequest] = []
    for i in range(rng.randrange(3, 10)):
        kind = rng.random()
        arrival = rng.randrange(0, 12 * (i + 1))
        max_tokens = rng.randrange(1, 3 * bs)
        if reqs and kind < 0.2:  # the same prompt again
            prompt = list(rng.choice(reqs).prompt_token_ids)
        elif reqs and kind < 0.45:  # the next turn of an earlier conversation
            earlier = rng.choice(reqs)
            reply = continuation(earlier.prompt_token_ids, earlier.max_tokens)
            message = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 2 * bs))]
            prompt = earlier.prompt_token_ids + reply + message
            arrival = max(arrival, earlier.arrival_step + 2 * earlier.max_tokens)
        else:
            prompt = rng.choice(systems) + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 3 * bs))]
        reqs.append(SimRequest(f"q{i}", prompt, max_tokens, arrival))
    groups = rng.choice([1, 3])
    need = max(-(-(len(r.prompt_token_ids) + r.max_tokens) // bs) for r in reqs) + 3 * groups + 2
    kwargs = {
        "block_size": bs,
        "max_num_batched_tokens": bs * rng.randrange(2, 6),
        "max_num_seqs": rng.choice([2, 4, 8]),
        "num_mamba_groups": groups,
        "max_model_len": 4096,
    }
    return reqs, kwargs, sorted({need, need + 2, need + 5, 3 * need // 2, 2 * need, 4 * need, 1000})


def replay_both(reqs, kwargs, num_blocks, qwen3_next_dir, check: bool = True):
    align = replay("align", reqs, qwen3_next_dir, num_blocks=num_blocks, max_steps=20_000, **kwargs)
    ours = replay_with_shadow(
        reqs, qwen3_next_dir, num_blocks=num_blocks, max_steps=20_000,
        check=(lambda scheduler, output, step: check_pool(scheduler)) if check else None, **kwargs,
    )
    check_all_returned(ours.scheduler)
    return align, ours


@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1))
def test_random_traces_at_every_pool_size(qwen3_next_dir, seed):
    reqs, kwargs, pools = random_trace(seed)
    for num_blocks in pools:
        align, ours = replay_both(reqs, kwargs, num_blocks, qwen3_next_dir)
        assert ours.outputs == align.outputs
        if align.evicted_state_blocks + align.evicted_attn_blocks == 0 and ours.evicted_state_blocks + (
            ours.evicted_attn_blocks
        ) == 0:
            # No memory pressure: the lighter cache caches a superset of align's states.
            assert ours.cached_tokens >= align.cached_tokens, (num_blocks, ours.cached_per_request)


def test_more_hit_tokens_than_align_summed_over_traces_at_every_pool_size(qwen3_next_dir):
    """Pool sizes relative to what the trace needs (smallest, +2, +5, x1.5, x2, x4 blocks)."""
    totals: dict[int, list[int]] = {}
    for seed in range(60):
        reqs, kwargs, pools = random_trace(seed)
        for rank, num_blocks in enumerate(pools[:6]):
            align = replay("align", reqs, qwen3_next_dir, num_blocks=num_blocks, max_steps=20_000, **kwargs)
            ours = replay("lighter", reqs, qwen3_next_dir, num_blocks=num_blocks, max_steps=20_000, **kwargs)
            pair = totals.setdefault(rank, [0, 0])
            pair[0] += ours.cached_tokens
            pair[1] += align.cached_tokens
    for rank, (ours_total, align_total) in totals.items():
        assert ours_total >= align_total, (rank, ours_total, align_total)


@pytest.mark.xfail(strict=True, reason="under pressure the lighter cache's extra states can push out one "
                   "align keeps, with vLLM's LRU order or with the retention policy")
@pytest.mark.parametrize(
    ("mode", "seed", "num_blocks"),
    [
        # q3's decode end (160), which q5 continues, ranked below states of other chains.
        ("lighter", 5, 40),
        # q4's decode end, which q6 continues, evicted first in LRU order.
        ("lighter:off", 98, 33),
    ],
)
def test_known_trace_below_align_under_pressure(qwen3_next_dir, mode, seed, num_blocks):
    reqs, kwargs, _ = random_trace(seed)
    align = replay("align", reqs, qwen3_next_dir, num_blocks=num_blocks, **kwargs)
    ours = replay(mode, reqs, qwen3_next_dir, num_blocks=num_blocks, **kwargs)
    assert align.preemptions == ours.preemptions == 0
    assert ours.cached_tokens >= align.cached_tokens
