"""benchmarks/explain_pressure_case.py: one property-suite case step by step, with every
evicted page and why the retention policy picked it."""

from __future__ import annotations

import re

import pytest

from vllm_lighter_mamba.bench.sim import replay
from vllm_lighter_mamba.bench.workloads import history_trace
from vllm_lighter_mamba.v1.core.retention_policy import EVICTION_REASONS

from . import load_benchmark

SEED, POOL = 107, 30  # a case where both modes evict (seed 107's fifth pool)


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("explain_pressure_case")


def evictions(lines: list[str]) -> list[str]:
    """The reasons of the "evicted ..." lines, in order."""
    return [re.match(r"\s+evicted .*: (\w+)", line).group(1)
            for line in lines if line.lstrip().startswith("evicted")]


@pytest.mark.parametrize("mode", ["align", "lighter:inside"])
def test_every_eviction_is_listed_with_its_reason(bench, qwen3_next_dir, mode):
    """As many eviction lines as the replay evicted cached pages; the policy's reasons for the
    lighter cache (at least one page it picked itself), none but LRU for align; the hit tokens
    those of a replay of the same case."""
    requests, kwargs, _ = history_trace(SEED)
    lines = bench.explain(mode, requests, qwen3_next_dir, POOL, kwargs)
    reference = replay(mode, requests, qwen3_next_dir, num_blocks=POOL, max_steps=20_000, **kwargs)
    reasons = evictions(lines)
    assert len(reasons) == reference.evicted_state_blocks + reference.evicted_attn_blocks > 0
    assert set(reasons) <= set(EVICTION_REASONS)
    if mode == "align":
        assert set(reasons) == {"lru"}
    else:
        assert set(reasons) - {"lru"}
    assert lines[-1].startswith(f"hit tokens: {reference.cached_tokens} ")


def test_the_trace_says_what_each_request_shares(bench):
    requests, _, _ = history_trace(SEED)
    lines = bench.describe_trace(requests)
    assert len(lines) == len(requests)
    # q1 is the next turn of q0 (22-token prompt, 4-token reply): 22 tokens of prompt in
    # common, 26 with the reply.
    assert lines[1].endswith("shares q0:22/26")


def test_the_oracle_mode_replays_with_the_oracles_order(bench, qwen3_next_dir):
    """``--modes oracle``: the lighter cache with benchmark_oracle_eviction's order, its
    evictions marked as the oracle's, its hit tokens those of that benchmark's replay."""
    requests, kwargs, _ = history_trace(SEED)
    lines = bench.explain("oracle", requests, qwen3_next_dir, POOL, kwargs)
    reference = load_benchmark("benchmark_oracle_eviction").replay_with_oracle(
        requests, qwen3_next_dir, POOL, **kwargs)
    reasons = evictions(lines)
    assert len(reasons) == reference.evicted_state_blocks + reference.evicted_attn_blocks
    assert "oracle" in reasons and set(reasons) <= {"oracle", "lru"}
    assert lines[-1].startswith(f"hit tokens: {reference.cached_tokens} ")
