"""vllm.platforms.interface: one Mamba state per cache block once the block size is final."""

from __future__ import annotations

from typing import Any

from vllm.platforms import interface as upstream
from vllm.utils.math_utils import round_up

from vllm_lighter_mamba.config import check_block_size, is_active
from vllm_lighter_mamba.model_executor.layers.mamba.checkpoint import FLA_CHUNK, may_write_checkpoints
from vllm_lighter_mamba.patch._util import original, replace_attr


def _align_hybrid_block_size(cls: Any, vllm_config: Any, backend_cls: Any) -> None:
    upstream_fn = original(upstream.Platform, "_align_hybrid_block_size").__func__
    cache_config = vllm_config.cache_config
    if is_active(vllm_config) and cache_config.block_size and may_write_checkpoints(vllm_config):
        # Upstream's block is a multiple of the block size it finds (its kernel alignment is at
        # least that): on FLA's grid, every block boundary can be written inside a chunk, as
        # align's internal checkpoints make it lcm the block with their alignment.
        cache_config.block_size = round_up(cache_config.block_size, FLA_CHUNK)
    upstream_fn(cls, vllm_config, backend_cls)
    if not is_active(vllm_config):
        return
    # The only place the lighter cache writes the Mamba block size.
    cache_config.mamba_block_size = cache_config.block_size
    check_block_size(vllm_config)  # again in the scheduler, with the groups' final block size


def apply() -> None:
    replace_attr(upstream.Platform, "_align_hybrid_block_size", classmethod(_align_hybrid_block_size))
