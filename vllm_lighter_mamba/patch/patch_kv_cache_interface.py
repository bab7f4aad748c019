"""vllm.v1.kv_cache_interface: size Mamba block tables and budgets for our layout."""

from __future__ import annotations

from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1 import kv_cache_interface as upstream

from vllm_lighter_mamba.config import lighter_layout_active
from vllm_lighter_mamba.patch._util import original, replace_attr


def _max_num_blocks_per_req(self: Any, vllm_config: Any, max_len: int) -> int:
    if not lighter_layout_active(vllm_config.cache_config):
        return original(upstream.MambaSpec, "max_num_blocks_per_req")(self, vllm_config, max_len)
    # Rows are position-indexed over the whole sequence (most entries are null blocks).
    return cdiv(max_len, self.block_size) + self.num_speculative_blocks


def _max_memory_usage_bytes(self: Any, vllm_config: Any) -> int:
    if not lighter_layout_active(vllm_config.cache_config):
        return original(upstream.MambaSpec, "max_memory_usage_bytes")(self, vllm_config)
    # Resident per request: the running block(s) and the previous one (this step's copy
    # source, or the prefix hit), which is freed one step later.
    return self.page_size_bytes * (2 + self.num_speculative_blocks)


def apply() -> None:
    replace_attr(upstream.MambaSpec, "max_num_blocks_per_req", _max_num_blocks_per_req)
    replace_attr(upstream.MambaSpec, "max_memory_usage_bytes", _max_memory_usage_bytes)
