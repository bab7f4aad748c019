"""Block-pool invariants checked after every scheduler step and every scenario."""

from __future__ import annotations

from collections import Counter


def expected_ref_counts(scheduler) -> Counter:
    """How many live references each block should have, from the managers' own tables."""
    counts: Counter = Counter()
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        for blocks in manager.req_to_blocks.values():
            for block in blocks:
                if not block.is_null:
                    counts[block.block_id] += 1
        for state in getattr(manager, "states", {}).values():
            for _, block in state.detached:
                counts[block.block_id] += 1
    return counts


def check_pool(scheduler) -> None:
    """Every block's ref count equals its references; free blocks have none."""
    pool = scheduler.kv_cache_manager.block_pool
    expected = expected_ref_counts(scheduler)
    for block in pool.blocks:
        if block.is_null:
            continue
        assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
        assert block.ref_cnt == expected.get(block.block_id, 0), (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
            f"{expected.get(block.block_id, 0)} references"
        )
    num_referenced = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt > 0)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - num_referenced


def check_all_returned(scheduler) -> None:
    """After every request finished, the pool is back to its initial free count."""
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not any(manager.req_to_blocks.values())
        assert not getattr(manager, "states", {}), "per-request manager state leaked"
