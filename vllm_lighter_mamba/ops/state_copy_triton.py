"""The per-step state copy on the GPU: plan and copy in one launch for every Mamba state
tensor of every lighter KV-cache group, without the host looking at any device value.

Each program handles one (request, state tensor) pair. It derives the copy from the same
inputs and the same rule as :func:`mamba_state_indices` (the request's block moves this
step when ``(computed - 1) // block_size != (seq_len - 1) // block_size``) and copies the
state's bytes from the source block to the destination block. The tensors are described
by a persistent int64 table (one row per state tensor, built once when the KV cache
exists), so the launch takes the same few arguments every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns of the state-tensor table, in this order (the kernel reads them by position).
FIELDS = ("base_address", "block_stride_words", "words_per_block", "block_table_address",
          "block_table_row_stride", "block_size", "max_blocks")
NUM_FIELDS = len(FIELDS)
_COPY_BLOCK = 1024


@triton.jit(do_not_specialize=["num_reqs"])
def _copy_states_kernel(
    entries_ptr, seq_lens_ptr, query_lens_ptr, num_reqs,
    WORD: tl.constexpr, NUM_FIELDS_C: tl.constexpr, COPY_BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    entry = entries_ptr + tl.program_id(1) * NUM_FIELDS_C
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int64)
    computed = seq_len - tl.load(query_lens_ptr + r).to(tl.int64)
    block_size = tl.load(entry + 5)
    max_blocks = tl.load(entry + 6)
    first = tl.where(seq_len > 0, (seq_len - 1) // block_size, 0)
    source_pos = tl.where(computed > 0, (computed - 1) // block_size, 0)
    moves = (computed > 0) & (source_pos != first) & (first < max_blocks)
    row = tl.load(entry + 3).to(tl.pointer_type(tl.int32)) + r * tl.load(entry + 4)
    src = tl.load(row + source_pos, mask=moves, other=0).to(tl.int64)
    dst = tl.load(row + first, mask=moves, other=0).to(tl.int64)
    base = tl.load(entry + 0).to(tl.pointer_type(WORD))
    stride = tl.load(entry + 1)
    # No copy: a zero-length loop (moves is a scalar of this program).
    num_words = tl.where(moves, tl.load(entry + 2), 0)
    src_ptr = base + src * stride
    dst_ptr = base + dst * stride
    for start in range(0, num_words, COPY_BLOCK):
        offsets = start + tl.arange(0, COPY_BLOCK)
        mask = offsets < num_words
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def word_dtype(byte_values: list[int]) -> torch.dtype:
    """The widest word that divides every address, stride and size of the table."""
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if all(value % size == 0 for value in byte_values):
            return dtype
    return torch.uint8


_TL_WORDS = {torch.int32: tl.int32, torch.int16: tl.int16, torch.uint8: tl.uint8}


def copy_states_triton(
    entries: torch.Tensor, word: torch.dtype, seq_lens: torch.Tensor, query_lens: torch.Tensor
) -> None:
    """Launch the fused plan-and-copy for ``seq_lens.shape[0]`` requests."""
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or entries.shape[0] == 0:
        return
    _copy_states_kernel[(num_reqs, entries.shape[0])](
        entries, seq_lens, query_lens, num_reqs,
        WORD=_TL_WORDS[word], NUM_FIELDS_C=NUM_FIELDS, COPY_BLOCK=_COPY_BLOCK,
    )
