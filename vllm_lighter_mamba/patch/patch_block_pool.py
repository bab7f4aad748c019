"""vllm.v1.core.block_pool: count evicted Mamba boundary states."""

from __future__ import annotations

from typing import Any

from vllm.v1.core import block_pool as upstream
from vllm.v1.core.kv_cache_utils import get_group_id

from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.metrics.counters import COUNTERS, MAMBA_GROUP_IDS


def _remove_cached_block_hashes(self: Any, block: Any) -> Any:
    removed = original(upstream.BlockPool, "_remove_cached_block_hashes")(self, block)
    if removed and MAMBA_GROUP_IDS:
        COUNTERS.states_evicted += sum(get_group_id(h) in MAMBA_GROUP_IDS for h in removed)
    return removed


def apply() -> None:
    replace_attr(upstream.BlockPool, "_remove_cached_block_hashes", _remove_cached_block_hashes)
