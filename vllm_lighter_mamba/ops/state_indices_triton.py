"""Triton (GPU) implementation of :func:`mamba_state_indices`: one launch per call."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_lighter_mamba.ops.state_indices import StateIndices

_BLOCK_R = 128


# Triton specializes integer arguments (== 1, divisible by 16) by default: every new batch
# size or table width could then compile another variant in the middle of serving (a
# visible TTFT stall on the GPU). These change every step, so they are plain runtime values.
@triton.jit(do_not_specialize=["table_stride", "max_blocks", "num_reqs", "block_size"])
def _gather_kernel(
    block_table_ptr, table_stride, max_blocks,
    seq_lens_ptr, query_lens_ptr,
    state_indices_ptr, copy_src_ptr, copy_dst_ptr,
    num_reqs, block_size,
    NUM_COLS: tl.constexpr, HAS_QUERY: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < num_reqs
    row_base = block_table_ptr + rows.to(tl.int64) * table_stride
    seq_len = tl.load(seq_lens_ptr + rows, mask=valid, other=0).to(tl.int32)
    first = tl.where(seq_len > 0, (seq_len - 1) // block_size, 0)
    for j in tl.static_range(NUM_COLS):
        pos = first + j
        inside = valid & (pos < max_blocks)
        value = tl.load(row_base + pos, mask=inside, other=-1)
        tl.store(state_indices_ptr + rows * NUM_COLS + j, value, mask=valid)
    if HAS_QUERY:
        computed = seq_len - tl.load(query_lens_ptr + rows, mask=valid, other=0).to(tl.int32)
        source_pos = tl.where(computed > 0, (computed - 1) // block_size, 0)
        moves = valid & (computed > 0) & (source_pos != first) & (first < max_blocks)
        src = tl.load(row_base + source_pos, mask=moves, other=-1)
        dst = tl.load(row_base + first, mask=moves, other=-1)
        tl.store(copy_src_ptr + rows, src, mask=valid)
        tl.store(copy_dst_ptr + rows, dst, mask=valid)


def state_indices_triton(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_spec_blocks: int = 0,
    query_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> StateIndices:
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    num_reqs = seq_lens.shape[0]
    num_cols = 1 + num_spec_blocks
    device, dtype = block_table.device, block_table.dtype
    if out is None:
        out = torch.empty((num_reqs, num_cols), dtype=dtype, device=device)
    has_query = query_lens is not None
    copy_src = torch.empty(num_reqs if has_query else 0, dtype=dtype, device=device)
    copy_dst = torch.empty_like(copy_src)
    if num_reqs > 0:
        grid = (triton.cdiv(num_reqs, _BLOCK_R),)
        _gather_kernel[grid](
            block_table, block_table.stride(0), block_table.shape[1],
            seq_lens, query_lens if has_query else seq_lens,
            out, copy_src, copy_dst,
            num_reqs, block_size,
            NUM_COLS=num_cols, HAS_QUERY=has_query, BLOCK_R=_BLOCK_R,
        )
    if not has_query:
        return StateIndices(out, None, None)
    return StateIndices(out, copy_src, copy_dst)
