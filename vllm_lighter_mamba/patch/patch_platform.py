"""vllm.platforms.interface: one Mamba state per cache block once the block size is final."""

from __future__ import annotations

from typing import Any

from vllm.platforms import interface as upstream

from vllm_lighter_mamba.config import check_block_size, is_active
from vllm_lighter_mamba.patch._util import original, replace_attr


def _align_hybrid_block_size(cls: Any, vllm_config: Any, backend_cls: Any) -> None:
    upstream_fn = original(upstream.Platform, "_align_hybrid_block_size").__func__
    upstream_fn(cls, vllm_config, backend_cls)
    if not is_active(vllm_config):
        return
    cache_config = vllm_config.cache_config
    # The only place the lighter cache writes the Mamba block size.
    cache_config.mamba_block_size = cache_config.block_size
    check_block_size(vllm_config)  # again in the scheduler, with the groups' final block size


def apply() -> None:
    replace_attr(upstream.Platform, "_align_hybrid_block_size", classmethod(_align_hybrid_block_size))
