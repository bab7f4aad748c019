"""The lighter cache against vLLM's align mode over random traces (system prompts, exact
repeats, multi-turn continuations) at pool sizes from the smallest that runs every request to
one that never evicts.

What holds on every trace and pool size: every state read is the right one (shadow worker),
the pool's invariants and the retention policy's bookkeeping hold after every step, outputs
are align's, and without memory pressure the lighter cache never gets fewer hit tokens.

What does not: "never fewer hit tokens than align under pressure". On 200 of these traces x 6
pool sizes the lighter cache was below align in 14.2% of the cases with evictions with the
retention policy and 9.4% with vLLM's LRU order (2026-12-01,
``benchmarks/benchmark_pressure_traces.py``): it caches more states than align
(cold-prompt checkpoints, junction stops), which in a nearly full pool push out a state align
keeps, and no eviction order can beat LRU on every trace. Summed over the traces it gets more
hit tokens than align at every pool size (test below; 1.08x with the policy, 1.05x without);
a known counterexample per mode is kept as a strict xfail.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_lighter_mamba.bench.sim import replay
from vllm_lighter_mamba.bench.workloads import history_trace

from .invariants import check_all_returned, check_pool
from .shadow import replay_with_shadow


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
    reqs, kwargs, pools = history_trace(seed)
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
        reqs, kwargs, pools = history_trace(seed)
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
        # q1 resumes at 144 with align, at 112 here: its state at 144 was evicted. (With vLLM
        # 0.26 this was seed 5 at 40 blocks; against 0.32's align the lighter cache is ahead
        # there, 720 hit tokens to 672.)
        ("lighter", 10, 52),
        # q4's decode end, which q6 continues, evicted first in LRU order (with cold-prompt
        # checkpoints; without them, the default since 2026-12-05, this trace is not below align).
        ("lighter:off,ckpt=1/2/4", 98, 33),
    ],
)
def test_known_trace_below_align_under_pressure(qwen3_next_dir, mode, seed, num_blocks):
    reqs, kwargs, _ = history_trace(seed)
    # Against align keeping every chunk end's state (``retention_interval=None``): under vLLM's
    # default sparse retention (0) align keeps fewer and the lighter cache is not below it.
    align = replay("align", reqs, qwen3_next_dir, num_blocks=num_blocks, retention_interval=None, **kwargs)
    ours = replay(mode, reqs, qwen3_next_dir, num_blocks=num_blocks, **kwargs)
    assert align.preemptions == ours.preemptions == 0
    assert ours.cached_tokens >= align.cached_tokens
