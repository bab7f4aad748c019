"""The per-step state copy: the running state moves to this step's block before forward."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_lighter_mamba.ops.state_indices import mamba_state_indices


def mamba_groups(kv_cache_config: Any) -> list[tuple[int, MambaSpec, list[str]]]:
    return [
        (group_id, group.kv_cache_spec, list(group.layer_names))
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, MambaSpec)
    ]


def copy_states(state_tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """``t[dst] = t[src]`` for every state tensor of a layer (dim 0 is the block)."""
    for tensor in state_tensors:
        tensor.index_copy_(0, dst, tensor.index_select(0, src))


def copy_running_states(runner: Any, num_scheduled_tokens: np.ndarray) -> int:
    """Copy each moving request's state into this step's block; returns the copies made.

    The plan comes from the CPU copy of the block table and the CPU token counts (numba,
    no device sync); only the few requests whose state block changes this step (a chunk
    starting at a boundary, a hit, decode crossing a boundary) get copied.
    """
    groups = getattr(runner, "_lighter_mamba_groups", None)
    if groups is None:
        groups = mamba_groups(runner.kv_cache_config)
        runner._lighter_mamba_groups = groups
    if not groups:
        return 0
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    query_lens = torch.from_numpy(np.ascontiguousarray(num_scheduled_tokens[:num_reqs]))
    computed = torch.from_numpy(batch.num_computed_tokens_cpu[:num_reqs])
    seq_lens = computed.to(query_lens.dtype) + query_lens
    forward_context = runner.compilation_config.static_forward_context
    num_copies = 0
    for group_id, spec, layer_names in groups:
        table = batch.block_table[group_id].get_cpu_tensor()[:num_reqs]
        plan = mamba_state_indices(
            table, seq_lens, spec.block_size, spec.num_speculative_blocks, query_lens
        )
        moving = plan.copy_src >= 0
        if not bool(moving.any()):
            continue
        src = plan.copy_src[moving].long().to(runner.device, non_blocking=True)
        dst = plan.copy_dst[moving].long().to(runner.device, non_blocking=True)
        for name in layer_names:
            copy_states(forward_context[name].kv_cache, src, dst)
        num_copies += int(moving.sum())
    return num_copies
