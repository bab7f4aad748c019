"""The Mamba block manager with vLLM's real BlockPool, KVCacheManager and hybrid
coordinator. A shadow worker replays every step's copies and state reads/writes, so a
wrong block, an early free or a hit on the wrong state fails the test."""

from __future__ import annotations

import random

import pytest

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


@pytest.mark.parametrize(("mode", "chunks"), [
    # 200 tokens with a 64-token budget, last cache position 192: chunks of 64, 64, 64 (to
    # align's end, 192), the tail (no cold-prompt checkpoints: the default)
    ("lighter", [64, 64, 64, 8]),
    # with checkpoints 1, 2 and 4 blocks before 192: 64, 64, then 160 and 176, 192, the tail
    ("lighter:ckpt=1/2/4", [64, 64, 32, 16, 16, 8]),
])
def test_no_hit_chunked_prefill_then_decode(qwen3_next_dir, mode, chunks):
    reqs = [SimRequest("a", list(range(200)), max_tokens=40)]
    result = run(reqs, layout_checker(), model=qwen3_next_dir, mode=mode)
    assert result.cached_per_request["a"] == 0
    assert [c[2] for c in result.chunks[:len(chunks)]] == chunks
    # The shadow worker copied the state at every chunk boundary and decode crossing.
    assert result.shadow.num_copies >= 3


def test_hit_at_k_blocks(qwen3_next_dir):
    prefix = list(range(100))
    reqs = [
        SimRequest("first", prefix + [1, 2, 3], max_tokens=4),
        SimRequest("second", prefix + [4, 5, 6, 7], max_tokens=4, arrival_step=20),
    ]
    result = run(reqs, layout_checker(), model=qwen3_next_dir)
    # 100 shared tokens: 6 full blocks; the first prompt's chunks ended at 64 (budget) and 96
    # (its last cache position).
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


def test_speculative_blocks_are_allocated_and_reused(qwen3_next_dir, monkeypatch):
    """Last step's speculative blocks that a step jumps past are moved to the new positions,
    not freed and allocated again: a chunk that moves the running block by 4 positions with
    2 speculative blocks takes 1 fresh block from the pool, not 3."""
    jumps = []
    upstream = LighterMambaManager.allocate_new_blocks

    def spy(self, request_id, num_tokens, num_tokens_main_model):
        state = self.states.get(request_id)
        previous = state.running_pos if state is not None else None
        free_before = self.block_pool.get_num_free_blocks()
        new = upstream(self, request_id, num_tokens, num_tokens_main_model)
        first = running_position(num_tokens_main_model, BS)
        if previous is not None and first - previous > 2:
            jumps.append(free_before - self.block_pool.get_num_free_blocks())
        return new

    monkeypatch.setattr(LighterMambaManager, "allocate_new_blocks", spy)
    reqs = [SimRequest("s", list(range(200)), max_tokens=20)]
    result = run(reqs, layout_checker(num_spec=2), model=qwen3_next_dir, num_speculative_blocks=2)
    assert len(result.outputs["s"]) == 20
    assert jumps and all(fresh == 1 for fresh in jumps), jumps


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


@pytest.mark.parametrize("num_spec", [0, 2])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_resident_state_blocks_match_the_memory_estimate(qwen3_next_dir, async_scheduling, num_spec):
    """Issue 13: the spec promises vLLM ``resident_blocks_per_request`` state pages per
    request; a chunked prefill under async overlap reaches it and never exceeds it."""
    from vllm_lighter_mamba.v1.kv_cache_interface import resident_blocks_per_request

    limit = resident_blocks_per_request(num_spec, async_scheduling)
    peak = [0]

    def check(scheduler, output, step):
        manager = mamba_manager(scheduler)
        spec = manager.kv_cache_spec
        assert spec.max_memory_usage_bytes(scheduler.vllm_config) == limit * spec.page_size_bytes
        for rid, blocks in manager.req_to_blocks.items():
            state = manager.states.get(rid)
            held = sum(not b.is_null for b in blocks) + (len(state.detached) if state else 0)
            peak[0] = max(peak[0], held)

    reqs = [SimRequest("p", list(range(300)), max_tokens=20)]
    replay_with_shadow(reqs, qwen3_next_dir, check=check, block_size=BS, max_num_batched_tokens=32,
                       num_speculative_blocks=num_spec, async_scheduling=async_scheduling,
                       overlap=async_scheduling)
    assert peak[0] == limit
