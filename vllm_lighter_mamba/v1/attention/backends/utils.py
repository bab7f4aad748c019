"""The builders' state-index lookup, served by our gather kernel."""

from __future__ import annotations

import torch
from vllm.v1.attention.backends import utils as upstream_utils
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

from vllm_lighter_mamba.envs import lighter_mamba_enabled
from vllm_lighter_mamba.ops.state_indices import mamba_state_indices


def lighter_mamba_block_table_tensor(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_cache_spec: KVCacheSpec,
    mamba_cache_mode: str,
) -> torch.Tensor:
    """Same signature as vLLM's ``mamba_get_block_table_tensor``.

    With the variable on, the start-up check leaves ``mamba_cache_mode`` at ``"none"``
    while the block table is position-indexed (our layout), so "none" means ours here.
    """
    ours = lighter_mamba_enabled() and mamba_cache_mode == "none"
    if not ours or not isinstance(kv_cache_spec, MambaSpec):
        return upstream_utils.mamba_get_block_table_tensor(
            block_table, seq_lens, kv_cache_spec, mamba_cache_mode
        )
    return mamba_state_indices(
        block_table,
        seq_lens,
        kv_cache_spec.block_size,
        kv_cache_spec.num_speculative_blocks,
    ).state_indices
