"""The lighter cache's counters (exported as vllm:lighter_mamba_* on /metrics): kept per
engine, counted per request and per boundary whatever the number of Mamba groups."""

from __future__ import annotations

from vllm_lighter_mamba.bench.sim import SimRequest, make_scheduler, replay
from vllm_lighter_mamba.patch.patch_engine_core import lighter_mamba_counters
from vllm_lighter_mamba.v1.metrics.counters import LighterMambaCounters

PREFIX = list(range(1, 101))
# The trace is built around cold-prompt checkpoints at 1, 2 and 4 blocks (a setting, none by
# default).
MODE = "lighter:ckpt=1/2/4"
# A (cold, 150 tokens, last cache position 144): chunks end at 64 (budget 64), at the
# checkpoints 80 and 112 (4 and 2 blocks before 144), at 128 (align's end, owed; also the
# checkpoint 1 block before) and 144: no state at 96.
# B shares 100 tokens: attention could serve 96, the Mamba state only 80 -> 16 lost.
# C: B's chunk stopped at the 96 junction, so C gets the full 96.
TRACE = [
    SimRequest("a", PREFIX + list(range(500, 550)), max_tokens=2),
    SimRequest("b", PREFIX + [7, 7, 7], max_tokens=2, arrival_step=10),
    SimRequest("c", PREFIX + [8, 8], max_tokens=2, arrival_step=20),
]


def counters_of(result) -> LighterMambaCounters:
    return result.scheduler.lighter_counters


def test_cached_hit_and_lost_hit_counts(qwen3_next_dir):
    result = replay(MODE, TRACE, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    assert result.cached_per_request == {"a": 0, "b": 80, "c": 96}
    counts = counters_of(result)
    assert counts.state_hits == 2 and counts.state_hit_tokens == 80 + 96
    assert counts.state_hit_tokens == sum(result.cached_per_request.values())
    assert counts.lost_hit_tokens == 16 == sum(result.lost_per_request.values())
    assert counts.states_cached >= 6  # 64, 80, 112, 128, 144 (a), 96 (b), decode-filled blocks


def test_counts_do_not_multiply_with_mamba_groups(qwen3_next_dir):
    one = replay(MODE, TRACE, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    three = replay(
        MODE, TRACE, qwen3_next_dir, block_size=16, max_num_batched_tokens=64, num_mamba_groups=3
    )
    assert three.cached_per_request == one.cached_per_request
    assert counters_of(three).as_dict() == counters_of(one).as_dict()


def test_lost_hits_are_counted_once_per_request_however_long_it_waits(qwen3_next_dir):
    # One running request at a time: B waits for A to finish (its junction is known at every
    # lookup while it waits), and its lost tokens are counted once, at admission.
    reqs = [
        SimRequest("a", PREFIX + list(range(500, 550)), max_tokens=30),
        SimRequest("b", PREFIX + [7, 7, 7], max_tokens=2, arrival_step=8),
    ]
    result = replay(MODE, reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64, max_num_seqs=1)
    waited = min(s for rid, _, _, s in result.chunks if rid == "b") - 8
    assert waited > 3
    assert counters_of(result).lost_hit_tokens == result.lost_per_request["b"] == 16


def test_counters_are_per_engine(qwen3_next_dir):
    first = replay(MODE, TRACE, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    second = replay(MODE, TRACE[:1], qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    assert counters_of(second).state_hits == 0 and counters_of(first).state_hits == 2


def test_evictions_are_counted(qwen3_next_dir):
    reqs = [SimRequest(f"e{i}", [i + 1] * 200, max_tokens=2, arrival_step=3 * i) for i in range(12)]
    result = replay(MODE, reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64, num_blocks=60)
    assert counters_of(result).states_evicted > 0


def test_no_counters_without_the_decision(qwen3_next_dir):
    result = replay("align", TRACE, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    assert result.scheduler.lighter_counters is None


def test_engine_core_utility_returns_the_counts(qwen3_next_dir):
    from types import SimpleNamespace

    result = replay(MODE, TRACE, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    core = SimpleNamespace(scheduler=result.scheduler)
    assert lighter_mamba_counters(core) == counters_of(result).as_dict()
    stock = SimpleNamespace(scheduler=make_scheduler("align", qwen3_next_dir))
    assert lighter_mamba_counters(stock) == {}
