"""The Mamba block manager with vLLM's real BlockPool, KVCacheManager and hybrid
coordinator. A shadow worker replays every step's copies and state reads/writes, so a
wrong block, an early free or a hit on the wrong state fails the test."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_lighter_mamba.bench.sim import SimRequest, replay
from vllm_lighter_mamba.v1.core.single_type_kv_cache_manager import (
    LighterMambaManager,
    new_positions,
    running_position,
)

from .invariants import check_all_returned, check_pool
from .shadow import replay_with_shadow

BS = 16


def mamba_manager(scheduler) -> LighterMambaManager:
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    assert isinstance(manager, LighterMambaManager)
    return manager


def layout_checker(num_spec=0, max_resident=None):
    """Few resident state blocks per request, at the positions the layout defines."""
    limit = max_resident if max_resident is not None else 2 + num_spec

    def check(scheduler, output, step):
        check_pool(scheduler)
        manager = mamba_manager(scheduler)
        for rid, blocks in manager.req_to_blocks.items():
            live = [i for i, b in enumerate(blocks) if not b.is_null]
            assert len(live) <= limit, (rid, live)
            if rid in output.num_scheduled_tokens:
                request = scheduler.requests[rid]
                first = running_position(request.num_computed_tokens, BS)
                assert all(not blocks[p].is_null for p in range(first, first + 1 + num_spec))

    return check


def run(reqs, check=None, **kwargs):
    kwargs.setdefault("block_size", BS)
    kwargs.setdefault("max_num_batched_tokens", 64)
    result = replay_with_shadow(reqs, kwargs.pop("model"), check=check, **kwargs)
    check_all_returned(result.scheduler)
    return result


def test_pure_position_helpers():
    assert running_position(0, 16) == 0
    assert running_position(16, 16) == 0
    assert running_position(17, 16) == 1
    assert list(new_positions(0, 40, 16, 0)) == [2]
    assert list(new_positions(0, 40, 16, 2)) == [2, 3, 4]
    assert list(new_positions(3, 40, 16, 0)) == []  # decode inside the running block
    assert list(new_positions(3, 49, 16, 0)) == [3]


def test_no_hit_chunked_prefill_then_decode(qwen3_next_dir):
    reqs = [SimRequest("a", list(range(200)), max_tokens=40)]
    result = run(reqs, layout_checker(), model=qwen3_next_dir)
    assert result.cached_per_request["a"] == 0
    # 200 tokens with a 64-token budget, last cache position 192: chunks of 64, 64, then
    # the cold-prompt checkpoints 160 and 176 (2 and 1 blocks before 192), 192, the tail.
    assert [c[2] for c in result.chunks[:6]] == [64, 64, 32, 16, 16, 8]
    # The shadow worker copied the state at every chunk boundary and decode crossing.
    assert result.shadow.num_copies >= 3


def test_hit_at_k_blocks(qwen3_next_dir):
    prefix = list(range(100))
    reqs = [
        SimRequest("first", prefix + [1, 2, 3], max_tokens=4),
        SimRequest("second", prefix + [4, 5, 6, 7], max_tokens=4, arrival_step=20),
    ]
    result = run(reqs, layout_checker(), model=qwen3_next_dir)
    # 100 shared tokens: 6 full blocks; the first prompt's chunks ended at 64 (budget),
    # 80 (a cold-prompt checkpoint inside align's last chunk 64..96) and 96.
    assert result.cached_per_request["second"] == 96


def test_decode_growth_crosses_blocks(qwen3_next_dir):
    reqs = [SimRequest("d", list(range(20)), max_tokens=60)]
    result = run(reqs, layout_checker(), model=qwen3_next_dir)
    assert len(result.outputs["d"]) == 60
    # 20 -> 80 tokens crosses 4 boundaries: 4 copies, each state block freed a step later.
    assert result.shadow.num_copies == 4


def test_decoded_tokens_become_hits(qwen3_next_dir):
    first = SimRequest("first", list(range(20)), max_tokens=60)
    result = replay("lighter", [first], qwen3_next_dir, block_size=BS, max_num_batched_tokens=64)
    follower = SimRequest("follower", list(range(20)) + result.outputs["first"][:40] + [1], max_tokens=2)
    both = run(
        [first, SimRequest(**{**follower.__dict__, "arrival_step": 200})],
        layout_checker(),
        model=qwen3_next_dir,
    )
    assert both.cached_per_request["follower"] == 48  # blocks filled by decode are hits too


def test_speculative_blocks_are_allocated_and_reused(qwen3_next_dir):
    reqs = [SimRequest("s", list(range(70)), max_tokens=40)]
    result = run(reqs, layout_checker(num_spec=2), model=qwen3_next_dir, num_speculative_blocks=2)
    assert len(result.outputs["s"]) == 40


def test_preemption_and_resume(qwen3_next_dir):
    rng = random.Random(3)
    reqs = [
        SimRequest(f"p{i}", [rng.randrange(500) for _ in range(90)], max_tokens=50, arrival_step=i)
        for i in range(6)
    ]
    result = run(reqs, layout_checker(), model=qwen3_next_dir, num_blocks=40)
    assert result.preemptions > 0
    assert all(len(v) == 50 for v in result.outputs.values())


def test_abort_mid_prefill(qwen3_next_dir):
    reqs = [
        SimRequest("abort", list(range(300)), max_tokens=10, abort_at_step=2),
        SimRequest("keep", list(range(50, 150)), max_tokens=10),
    ]
    result = run(reqs, layout_checker(), model=qwen3_next_dir)
    assert len(result.outputs["keep"]) == 10
    assert len(result.outputs["abort"]) == 0


def test_pool_exhaustion_waits_and_recovers(qwen3_next_dir):
    reqs = [SimRequest(f"x{i}", [i + 1] * 120, max_tokens=8) for i in range(10)]
    # 30 blocks: two requests' attention blocks fill the pool.
    result = run(reqs, layout_checker(), model=qwen3_next_dir, num_blocks=30, max_num_seqs=8)
    assert all(len(v) == 8 for v in result.outputs.values())
    assert result.peak_blocks >= 26  # of 29 usable: the pool, not the budget, was the limit


def random_trace(seed: int) -> tuple[list[SimRequest], dict]:
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16])
    prefixes = [[rng.randrange(300) for _ in range(rng.randrange(0, 6 * block_size))] for _ in range(3)]
    reqs = []
    for i in range(rng.randrange(1, 7)):
        prompt = rng.choice(prefixes) + [rng.randrange(300) for _ in range(rng.randrange(1, 4 * block_size))]
        abort = rng.randrange(0, 40) if rng.random() < 0.15 else None
        reqs.append(
            SimRequest(f"q{i}", prompt, rng.randrange(1, 3 * block_size), rng.randrange(0, 30), abort)
        )
    budget = block_size * rng.randrange(1, 6) + rng.randrange(0, block_size)
    kwargs = {
        "block_size": block_size,
        "max_num_batched_tokens": budget,
        "num_blocks": rng.choice([3 * (8 * block_size) // block_size + 8, 200]),
        "max_num_seqs": rng.choice([2, 4, 8]),
    }
    return reqs, kwargs


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1))
def test_property_1000_random_traces(qwen3_next_dir, seed):
    reqs, kwargs = random_trace(seed)

    def check(scheduler, output, step):
        check_pool(scheduler)

    result = replay_with_shadow(reqs, qwen3_next_dir, check=check, max_steps=20_000, **kwargs)
    check_all_returned(result.scheduler)
    for r in reqs:
        hit = result.cached_per_request.get(r.request_id, 0)
        assert hit % kwargs["block_size"] == 0 and hit < len(r.prompt_token_ids)
        if r.abort_at_step is None:
            assert len(result.outputs[r.request_id]) == r.max_tokens


@pytest.mark.parametrize("seed", range(20))
def test_hits_not_shorter_than_align(qwen3_next_dir, seed):
    reqs, kwargs = random_trace(seed)
    reqs = [SimRequest(r.request_id, r.prompt_token_ids, r.max_tokens, r.arrival_step) for r in reqs]
    align = replay("align", reqs, qwen3_next_dir, **kwargs)
    ours = replay("lighter", reqs, qwen3_next_dir, **kwargs)
    assert ours.cached_tokens >= align.cached_tokens
    assert ours.outputs == align.outputs
