"""vllm.v1.core.block_pool: count evicted Mamba boundary states."""

from __future__ import annotations

from typing import Any

from vllm.v1.core import block_pool as upstream
from vllm.v1.core.kv_cache_utils import get_group_id

from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.metrics.counters import engine_counters, primary_group


def _maybe_evict_cached_block(self: Any, block: Any) -> bool:
    group = primary_group(self)  # None unless a lighter Mamba manager uses this pool
    is_state = group is not None and block.block_hash is not None and get_group_id(block.block_hash) == group
    evicted = original(upstream.BlockPool, "_maybe_evict_cached_block")(self, block)
    if evicted and is_state:
        engine_counters(self).states_evicted += 1
    return evicted


def apply() -> None:
    replace_attr(upstream.BlockPool, "_maybe_evict_cached_block", _maybe_evict_cached_block)
