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
          "block_table_row_stride", "block_size", "max_blocks", "token_row_words")
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


@triton.jit
def _copy_token_state(row, base, stride, num_words, token_row_words, max_blocks,
                      running, token, dst_pos, active, COPY_BLOCK: tl.constexpr):
    """Copy the state of the step's token ``token`` into position ``dst_pos``: a temporal
    tensor (``token_row_words == 0``) from position ``running + token``, a conv tensor from
    position ``running`` skipping ``token`` rows. Source and destination may be the same
    block (an in-place shift towards the block start): each chunk is loaded by every thread
    before any thread stores it, and chunks go in increasing order, so no word is
    overwritten before it is read."""
    is_conv = token_row_words > 0
    src_pos = tl.where(is_conv, running, running + token)
    skip = tl.where(is_conv, token * token_row_words, 0)
    active = active & (src_pos < max_blocks) & (dst_pos < max_blocks) & (dst_pos >= 0)
    src = tl.load(row + src_pos, mask=active, other=0).to(tl.int64)
    dst = tl.load(row + dst_pos, mask=active, other=0).to(tl.int64)
    count = tl.where(active, num_words - skip, 0)
    src_ptr = base + src * stride + skip
    dst_ptr = base + dst * stride
    for start in range(0, count, COPY_BLOCK):
        offsets = start + tl.arange(0, COPY_BLOCK)
        mask = offsets < count
        values = tl.load(src_ptr + offsets, mask=mask)
        tl.debug_barrier()
        tl.store(dst_ptr + offsets, values, mask=mask)
        tl.debug_barrier()


@triton.jit(do_not_specialize=["num_reqs"])
def _settle_kernel(
    entries_ptr, seq_lens_ptr, query_lens_ptr, accepted_ptr, drafts_ptr, num_reqs,
    WORD: tl.constexpr, NUM_FIELDS_C: tl.constexpr, COPY_BLOCK: tl.constexpr,
):
    """``spec_settle.settle_moves`` for every spec-decode row (``drafts >= 0``)."""
    r = tl.program_id(0)
    entry = entries_ptr + tl.program_id(1) * NUM_FIELDS_C
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int64)
    query_len = tl.load(query_lens_ptr + r).to(tl.int64)
    spec = (tl.load(drafts_ptr + r) >= 0) & (seq_len > 0) & (query_len > 0)
    accepted = tl.minimum(tl.maximum(tl.load(accepted_ptr + r).to(tl.int64), 1), query_len)
    block_size = tl.load(entry + 5)
    max_blocks = tl.load(entry + 6)
    computed = seq_len - query_len
    running = tl.where(seq_len > 0, (seq_len - 1) // block_size, 0)
    end = computed + accepted
    boundary = (computed // block_size + 1) * block_size
    row = tl.load(entry + 3).to(tl.pointer_type(tl.int32)) + r * tl.load(entry + 4)
    base = tl.load(entry + 0).to(tl.pointer_type(WORD))
    stride = tl.load(entry + 1)
    num_words = tl.load(entry + 2)
    token_row_words = tl.load(entry + 7)
    # 1. The boundary crossed strictly inside the accepted tokens, into its own block.
    _copy_token_state(row, base, stride, num_words, token_row_words, max_blocks, running,
                      boundary - computed - 1, boundary // block_size - 1,
                      spec & (boundary < end), COPY_BLOCK)
    tl.debug_barrier()
    # 2. The state after the last accepted token, to its running position, token row 0.
    last = accepted - 1
    dst = (end - 1) // block_size
    _copy_token_state(row, base, stride, num_words, token_row_words, max_blocks, running,
                      last, dst, spec & ((dst != running) | (last != 0)), COPY_BLOCK)


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


def settle_states_triton(
    entries: torch.Tensor,
    word: torch.dtype,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    accepted: torch.Tensor,
    drafts: torch.Tensor,
) -> None:
    """After sampling: put every spec-decode row's accepted states where the lighter layout
    reads them (``spec_settle``). ``accepted``: tokens accepted per row (vLLM's
    ``num_accepted_tokens``); ``drafts``: draft tokens per row, ``-1`` for other rows."""
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or entries.shape[0] == 0:
        return
    _settle_kernel[(num_reqs, entries.shape[0])](
        entries, seq_lens, query_lens, accepted, drafts, num_reqs,
        WORD=_TL_WORDS[word], NUM_FIELDS_C=NUM_FIELDS, COPY_BLOCK=_COPY_BLOCK,
    )
