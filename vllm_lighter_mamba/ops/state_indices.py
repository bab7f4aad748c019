"""One entry point that gathers, per request, the Mamba state blocks of this step.

From a Mamba group's block table (position ``i`` holds the state after token
``(i + 1) * block_size``) and per-request ``seq_lens`` (computed + scheduled tokens) and
``query_lens`` (scheduled tokens), it returns:

- ``state_indices`` ``[num_reqs, 1 + num_spec]``: the blocks the kernels read the initial
  state from and write the final state to, ``block_table[r, p + j]`` with
  ``p = max(seq_len - 1, 0) // block_size`` (``seq_len == 0``: a padding row of a CUDA-graph
  batch, reads position 0 like upstream); ``-1`` past the end of the table;
- ``copy_src`` / ``copy_dst`` ``[num_reqs]``: the per-step state copy. A request whose
  computed tokens ``c = seq_len - query_len`` are > 0 and whose state block changes this
  step (``(c - 1) // block_size != p``) copies ``block_table[r, (c - 1) // block_size]`` into
  ``block_table[r, p]`` before the forward; every other row holds ``-1`` in both.

Three implementations with identical results: Triton (CUDA tensors, one launch), numba
(CPU tensors) and torch (reference for tests). The runner's copy itself is fused with the
same plan in ``state_copy_triton`` (GPU) and planned with numba on the CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class StateIndices(NamedTuple):
    state_indices: torch.Tensor
    copy_src: torch.Tensor | None
    copy_dst: torch.Tensor | None


def mamba_state_indices(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_spec_blocks: int = 0,
    query_lens: torch.Tensor | None = None,
    backend: str | None = None,
) -> StateIndices:
    """Gather this step's state indices (and the copy pairs when ``query_lens`` is given).

    ``backend``: ``"triton"``, ``"numba"`` or ``"torch"``; by default Triton for CUDA
    tensors and numba for CPU tensors.
    """
    assert block_table.dim() == 2, "block_table must be [num_reqs, max_blocks]"
    assert block_table.shape[0] >= seq_lens.shape[0]
    if backend is None:
        backend = "triton" if block_table.is_cuda else "numba"
    if backend == "triton":
        from vllm_lighter_mamba.ops.state_indices_triton import state_indices_triton

        return state_indices_triton(block_table, seq_lens, block_size, num_spec_blocks, query_lens)
    if backend == "numba":
        from vllm_lighter_mamba.ops.state_indices_numba import state_indices_numba

        return state_indices_numba(block_table, seq_lens, block_size, num_spec_blocks, query_lens)
    if backend == "torch":
        return state_indices_torch(block_table, seq_lens, block_size, num_spec_blocks, query_lens)
    raise ValueError(f"unknown backend {backend!r}; expected triton, numba or torch")


# Per block table (one per KV-cache group, allocated once by the runner) and column count,
# the builders' output buffer. Kernels of one step read it before the next step's gather
# overwrites it: both are queued in order on the same stream.
_outputs: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def gather_state_indices(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_spec_blocks: int
) -> torch.Tensor:
    """The builders' call: ``state_indices`` only, into a preallocated output."""
    num_reqs = seq_lens.shape[0]
    key = (block_table.data_ptr(), 1 + num_spec_blocks, block_table.dtype, block_table.device)
    out = _outputs.get(key)
    if out is None or out.shape[0] < num_reqs:
        rows = max(num_reqs, block_table.shape[0])
        out = torch.empty((rows, 1 + num_spec_blocks), dtype=block_table.dtype, device=block_table.device)
        _outputs[key] = out
    out = out[:num_reqs]
    if block_table.is_cuda:
        from vllm_lighter_mamba.ops.state_indices_triton import state_indices_triton

        state_indices_triton(block_table, seq_lens, block_size, num_spec_blocks, out=out)
    else:
        from vllm_lighter_mamba.ops.state_indices_numba import state_indices_numba

        state_indices_numba(block_table, seq_lens, block_size, num_spec_blocks, out=out)
    return out


def state_indices_torch(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_spec_blocks: int = 0,
    query_lens: torch.Tensor | None = None,
) -> StateIndices:
    """Reference implementation (tests only): plain tensor ops, several launches."""
    num_reqs = seq_lens.shape[0]
    table = block_table[:num_reqs].long()
    max_blocks = table.shape[1]
    seq = seq_lens.long()
    first = torch.clamp(seq - 1, min=0) // block_size
    positions = first.unsqueeze(1) + torch.arange(1 + num_spec_blocks, device=seq.device)
    inside = positions < max_blocks
    gathered = torch.gather(table, 1, torch.where(inside, positions, 0))
    state_indices = torch.where(inside, gathered, -1).to(block_table.dtype)
    if query_lens is None:
        return StateIndices(state_indices, None, None)
    computed = seq - query_lens.long()
    source_pos = torch.clamp(computed - 1, min=0) // block_size
    moves = (computed > 0) & (source_pos != first) & (first < max_blocks)
    src = torch.gather(table, 1, torch.clamp(source_pos, max=max_blocks - 1).unsqueeze(1))[:, 0]
    minus_one = torch.full_like(src, -1)
    copy_src = torch.where(moves, src, minus_one).to(block_table.dtype)
    copy_dst = torch.where(moves, state_indices[:, 0].long(), minus_one).to(block_table.dtype)
    return StateIndices(state_indices, copy_src, copy_dst)


def warm_up_state_indices(device: torch.device | str, num_spec_blocks: int = 0) -> None:
    """Compile (or load from numba's on-disk cache) the kernel variants a step calls, at
    start-up rather than in the first requests (measured: ~0.3 s per numba signature, a
    TTFT stall of the first request on CPU; Triton compiles on first use the same way).

    vLLM's block tables are int32; token counts come as int32 or int64.
    """
    dev = torch.device(device)
    table = torch.zeros((1, 2 + num_spec_blocks), dtype=torch.int32, device=dev)
    for dtype in (torch.int32, torch.int64):
        seq_lens = torch.ones(1, dtype=dtype, device=dev)
        mamba_state_indices(table, seq_lens, 16, num_spec_blocks, seq_lens)
        mamba_state_indices(table, seq_lens, 16, num_spec_blocks)
    _outputs.clear()  # the warm-up table's buffer is not a real group's
