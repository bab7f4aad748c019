"""The builders' state-index lookup, served by our gather kernel."""

from __future__ import annotations

import torch
from vllm.v1.attention.backends import utils as upstream_utils
from vllm.v1.kv_cache_interface import KVCacheSpec

from vllm_lighter_mamba.ops.state_indices import gather_state_indices
from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec


def lighter_mamba_block_table_tensor(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_cache_spec: KVCacheSpec,
    mamba_cache_mode: str,
) -> torch.Tensor:
    """Same signature as vLLM's ``mamba_get_block_table_tensor``; ours for our spec only."""
    if not isinstance(kv_cache_spec, LighterMambaSpec):
        return upstream_utils.mamba_get_block_table_tensor(
            block_table, seq_lens, kv_cache_spec, mamba_cache_mode
        )
    return gather_state_indices(
        block_table, seq_lens, kv_cache_spec.block_size, kv_cache_spec.num_speculative_blocks
    )
