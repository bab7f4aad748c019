"""vllm.v1.core.block_pool: count evicted Mamba boundary states; apply the retention policy.

Every wrapper first asks whether this pool has a lighter engine's retention bookkeeping (set
up by the scheduler mixin); a pool without it (align, prefix caching off, other engines in
the process) runs upstream's code only. The policy never changes what the pool does with a
block, only which cached blocks sit at the front of its free queue when an allocation is
about to evict; a failure in the bookkeeping turns the policy off for that pool (vLLM's LRU
order from then on) instead of reaching the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.core import block_pool as upstream
from vllm.v1.core.kv_cache_utils import get_group_id

from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.core.block_pool_retention import retention_of
from vllm_lighter_mamba.v1.core.retention_guard import with_retention
from vllm_lighter_mamba.v1.core.single_type_kv_cache_manager import primary_group
from vllm_lighter_mamba.v1.metrics.counters import engine_counters


def _get_new_blocks(self: Any, num_blocks: int) -> list:
    with_retention(self, "before_allocation", lambda policy: policy.before_allocation(num_blocks), None)
    return original(upstream.BlockPool, "get_new_blocks")(self, num_blocks)


def _free_blocks(self: Any, ordered_blocks: Iterable[Any], **kwargs: Any) -> None:
    # ``kwargs``: upstream's options as the caller gives them (vLLM 0.34's ``evict_first``).
    if retention_of(self) is None:
        return original(upstream.BlockPool, "free_blocks")(self, ordered_blocks, **kwargs)
    blocks = list(ordered_blocks)  # upstream consumes the iterable; we look at it after
    original(upstream.BlockPool, "free_blocks")(self, blocks, **kwargs)
    with_retention(self, "after_free", lambda policy: policy.after_free(blocks), None)
    return None


def _cache_full_blocks(self: Any, request: Any, blocks: list, num_cached_blocks: int, num_full_blocks: int,
                       *args: Any, **kwargs: Any) -> None:
    original(upstream.BlockPool, "cache_full_blocks")(
        self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs
    )
    if num_full_blocks > num_cached_blocks and retention_of(self) is not None:
        new = blocks[num_cached_blocks:num_full_blocks]
        with_retention(self, "after_cache", lambda policy: policy.after_cache(new), None)


def _maybe_evict_cached_block(self: Any, block: Any) -> bool:
    group = primary_group(self)  # None unless a lighter Mamba manager uses this pool
    key = block.block_hash
    is_state = group is not None and key is not None and get_group_id(key) == group
    evicted = original(upstream.BlockPool, "_maybe_evict_cached_block")(self, block)
    if evicted and group is not None:
        counters = engine_counters(self)
        if is_state:
            counters.states_evicted += 1
            counters.states_held -= 1
        reason = with_retention(self, "after_evict", lambda policy: policy.after_evict(block, key), "lru")
        counters.record_eviction(reason)
    return evicted


def _reset_prefix_cache(self: Any) -> bool:
    done = original(upstream.BlockPool, "reset_prefix_cache")(self)
    if done and primary_group(self) is not None:
        engine_counters(self).states_held = 0
        with_retention(self, "reset_prefix_cache", lambda policy: policy.clear(), None)
    return done


def apply() -> None:
    replace_attr(upstream.BlockPool, "_maybe_evict_cached_block", _maybe_evict_cached_block)
    replace_attr(upstream.BlockPool, "get_new_blocks", _get_new_blocks)
    replace_attr(upstream.BlockPool, "free_blocks", _free_blocks)
    replace_attr(upstream.BlockPool, "cache_full_blocks", _cache_full_blocks)
    replace_attr(upstream.BlockPool, "reset_prefix_cache", _reset_prefix_cache)
