"""numba (CPU) implementation of :func:`mamba_state_indices`; same semantics as Triton."""

from __future__ import annotations

import numba
import numpy as np
import torch

from vllm_lighter_mamba.ops.state_indices import StateIndices


@numba.njit(cache=True, nogil=True)
def _gather(block_table, seq_lens, query_lens, has_query, block_size, num_spec,
            state_indices, copy_src, copy_dst):  # pragma: no cover - compiled
    max_blocks = block_table.shape[1]
    for r in range(seq_lens.shape[0]):
        seq_len = seq_lens[r]
        first = (seq_len - 1) // block_size if seq_len > 0 else 0
        for j in range(num_spec + 1):
            pos = first + j
            state_indices[r, j] = block_table[r, pos] if pos < max_blocks else -1
        if has_query:
            copy_src[r] = -1
            copy_dst[r] = -1
            computed = seq_len - query_lens[r]
            if computed > 0 and first < max_blocks:
                source_pos = (computed - 1) // block_size
                if source_pos != first:
                    copy_src[r] = block_table[r, source_pos]
                    copy_dst[r] = block_table[r, first]


def state_indices_numba(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_spec_blocks: int = 0,
    query_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> StateIndices:
    num_reqs = seq_lens.shape[0]
    table = block_table[:num_reqs].numpy()
    seq = seq_lens.numpy()
    has_query = query_lens is not None
    query = query_lens.numpy() if has_query else np.zeros(1, dtype=seq.dtype)
    if out is None:
        out = torch.empty((num_reqs, 1 + num_spec_blocks), dtype=block_table.dtype)
    copy_src = np.empty(num_reqs if has_query else 0, dtype=table.dtype)
    copy_dst = np.empty_like(copy_src)
    _gather(table, seq, query, has_query, block_size, num_spec_blocks,
            out.numpy(), copy_src, copy_dst)
    if not has_query:
        return StateIndices(out, None, None)
    return StateIndices(out, torch.from_numpy(copy_src), torch.from_numpy(copy_dst))
