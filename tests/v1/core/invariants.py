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
    check_retention(scheduler)


def check_retention(scheduler) -> None:
    """The retention policy's tree agrees with the pool (when the policy is on): every node's
    prefix has its attention cached, a node has a state exactly when every Mamba group has
    its page cached, liveness counts are exact, and the policy never turned itself off."""
    from vllm_lighter_mamba.v1.core.block_pool_retention import retention_of

    pool = scheduler.kv_cache_manager.block_pool
    retention = retention_of(pool)
    if getattr(scheduler, "lighter_mamba_active", False) and pool.enable_caching:
        assert retention is not None, "the retention policy turned itself off (see the log)"
    if retention is None:
        return
    for key, node in retention.tree.nodes.items():
        assert node.key == key
        assert pool.get_cached_block(key, retention.attention_groups) is not None, "node without attention"
        assert node.state == (pool.get_cached_block(key, retention.mamba_groups) is not None), key
        assert node.live_children == sum(1 for c in node.children if c.live)
        assert all(c.parent is node and retention.tree.nodes.get(c.key) is c for c in node.children)
        if node.parent is not None:
            assert node in node.parent.children and node.index == node.parent.index + 1
    assert not retention.pending, "victims picked but not evicted"


def check_all_returned(scheduler) -> None:
    """After every request finished, the pool is back to its initial free count."""
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not any(manager.req_to_blocks.values())
        assert not getattr(manager, "states", {}), "per-request manager state leaked"
    assert not len(getattr(scheduler, "lighter_plans", ())), "per-request retention plans leaked"
