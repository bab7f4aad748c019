"""The per-step state copy: the running state moves to this step's block before the forward.

A request's state lives in one block; when the block of its running position changes (a
chunk starting at a boundary, a prefix hit, decode crossing a boundary) the kernels of this
step must find the previous state in the new block. ``MambaStateCopier`` is built once per
worker when the KV cache exists and runs every step once the batch's block tables are in
place (V1 runner: after ``_prepare_inputs``; Model Runner V2: in
``MambaHybridModelState.preprocess_state``), unless the host's counts show that no request
moves:

- GPU: one Triton launch plans and copies for every state tensor of every lighter group,
  from the runner's persistent device buffers (block tables, ``seq_lens``, scheduled
  tokens), queued on the forward stream. The host reads no device value.
- CPU: the same plan with numba from the same (CPU) buffers, then one indexed copy per
  state tensor, only on steps where some request moves.

With speculative decoding every row reads column 0, and after sampling
:meth:`MambaStateCopier.settle` puts the accepted states where the next step reads them
(``ops/spec_settle.py``; one Triton launch on the GPU, tensor copies on the CPU).
"""

from __future__ import annotations

from collections import deque
from math import prod
from typing import Any

import numpy as np
import torch

from vllm_lighter_mamba.ops.spec_settle import SettleMove, settle_moves
from vllm_lighter_mamba.ops.state_indices import mamba_state_indices, warm_up_state_indices
from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec

# Where each runner keeps its copier (the V1 runner, Model Runner V2's model state).
COPIER_ATTR = "_lighter_mamba_state_copier"


def lighter_groups(kv_cache_config: Any) -> list[tuple[int, LighterMambaSpec, list[str]]]:
    """The KV-cache groups that use the lighter layout: (group id, spec, layer names)."""
    return [
        (group_id, group.kv_cache_spec, list(group.layer_names))
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, LighterMambaSpec)
    ]


def any_moves(computed: np.ndarray, scheduled: np.ndarray, block_sizes: list[int]) -> bool:
    """Whether some request's state block changes this step (the rule of the plan:
    ``c > 0`` and ``(c - 1) // block_size != (c + q - 1) // block_size``), from host counts.

    The host counts are exact without speculative decoding: under async spec decode vLLM's
    CPU counts assume every draft accepted and only the device's are exact, so with
    speculative blocks the copier does not ask.
    """
    started = computed > 0
    for block_size in block_sizes:
        if np.any(started & ((computed - 1) // block_size != (computed + scheduled - 1) // block_size)):
            return True
    return False


def copy_states(state_tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """``t[dst] = t[src]`` for every state tensor (dim 0 is the block)."""
    for tensor in state_tensors:
        tensor.index_copy_(0, dst, tensor.index_select(0, src))


class MambaStateCopier:
    """The per-step copy and the speculative settle of one worker, fed by its runner's
    per-step device tensors (V1: ``patch_gpu_model_runner``; Model Runner V2:
    ``patch_mamba_hybrid_model_state``). ``tables``: one block table per lighter group, rows
    in this step's batch order; ``seq_lens`` / ``query_lens``: per batch row, on the
    runner's device."""

    def __init__(self, forward_context: dict, kv_cache_config: Any, device: Any, model: Any) -> None:
        self.groups = [
            (group_id, spec, [t for name in names for t in forward_context[name].kv_cache])
            for group_id, spec, names in lighter_groups(kv_cache_config)
        ]
        self.on_gpu = torch.device(device).type == "cuda"
        self.block_sizes = sorted({spec.block_size for _, spec, _ in self.groups})
        # CPU path: requests moved so far and the latest (group, src, dst) block ids, which
        # tests compare across tensor- and pipeline-parallel ranks (the GPU path plans on the
        # device and keeps nothing on the host).
        self.num_moves = 0
        self.recent_moves: deque[tuple[int, int, int]] = deque(maxlen=256)
        self._table_key: tuple[int, ...] | None = None
        self._entries: torch.Tensor | None = None
        self._word = torch.uint8
        self.num_spec = max((spec.num_speculative_blocks for _, spec, _ in self.groups), default=0)
        self.conv_tensors = conv_state_tensors(model, self.groups) if self.num_spec else frozenset()

    def may_move(self, computed_host: np.ndarray, scheduled_host: np.ndarray) -> bool:
        """Whether this step may move a state, from the host's computed and scheduled tokens
        per batch row: a step in which no request moves (most decode steps) launches
        nothing. With speculative blocks always: under async scheduling the host's counts
        assume every draft accepted."""
        return bool(self.num_spec) or any_moves(computed_host, scheduled_host, self.block_sizes)

    def copy(self, tables: list[torch.Tensor], seq_lens: torch.Tensor, query_lens: torch.Tensor) -> None:
        """Move every request whose state block changes this step into its new block."""
        if self.on_gpu:
            from vllm_lighter_mamba.ops.state_copy_triton import copy_states_triton

            copy_states_triton(self._entries_for(tables), self._word, seq_lens, query_lens)
            return
        for (group_id, spec, tensors), table in zip(self.groups, tables, strict=True):
            plan = mamba_state_indices(
                table, seq_lens, spec.block_size, spec.num_speculative_blocks, query_lens
            )
            moving = plan.copy_src >= 0
            if bool(moving.any()):  # a CPU tensor: no device to wait for
                src, dst = plan.copy_src[moving].long(), plan.copy_dst[moving].long()
                copy_states(tensors, src, dst)
                self.num_moves += len(src)
                pairs = zip(src.tolist(), dst.tolist(), strict=True)
                self.recent_moves.extend((group_id, s, d) for s, d in pairs)

    def settle(
        self,
        tables: list[torch.Tensor],
        seq_lens: torch.Tensor,
        query_lens: torch.Tensor,
        accepted: torch.Tensor,
        drafts: torch.Tensor,
    ) -> None:
        """After sampling in a step with draft tokens: every spec-decode row's boundary state
        and last accepted state to their positions (``ops/spec_settle.py``), planned on the
        device from the accepted counts (GPU: one launch, no host sync; CPU: tensor copies
        per move). ``accepted``: tokens accepted per row (drafts accepted + 1); ``drafts``:
        draft tokens per row, ``-1`` for rows that are not spec-decode rows."""
        if not self.on_gpu:
            counts = (seq_lens, query_lens, accepted, drafts)
            seq_lens_l, query_lens_l, accepted_l, drafts_l = (c.tolist() for c in counts)
            spec_rows = [r for r in range(len(seq_lens_l)) if drafts_l[r] >= 0]
            for (_, spec, tensors), table in zip(self.groups, tables, strict=True):
                for r in spec_rows:
                    row = table[r].tolist()
                    for move in settle_moves(seq_lens_l[r], query_lens_l[r], accepted_l[r], spec.block_size):
                        apply_settle_move(tensors, self.conv_tensors, row, move)
            return
        from vllm_lighter_mamba.ops.state_copy_triton import settle_states_triton

        settle_states_triton(self._entries_for(tables), self._word, seq_lens, query_lens, accepted, drafts)

    def warm_up(self, tables: list[torch.Tensor], count_dtype: torch.dtype) -> None:
        """Compile the gather and copy kernels at start-up (a zero-length request moves
        nothing). ``tables``: the runner's block tables, at least one row each."""
        for num_spec in sorted({spec.num_speculative_blocks for _, spec, _ in self.groups}):
            warm_up_state_indices(tables[0].device, num_spec)
        if self.on_gpu:
            from vllm_lighter_mamba.ops.state_copy_triton import copy_states_triton, settle_states_triton

            tables = [table[:1] for table in tables]
            zeros = torch.zeros(1, dtype=count_dtype, device=tables[0].device)
            copy_states_triton(self._entries_for(tables), self._word, zeros, zeros)
            if self.num_spec:
                drafts = torch.full((1,), -1, dtype=torch.int32, device=zeros.device)
                settle_states_triton(self._entries_for(tables), self._word, zeros, zeros, zeros, drafts)

    def _entries_for(self, tables: list[torch.Tensor]) -> torch.Tensor:
        """The persistent state-tensor table; rebuilt only if a block table was replaced."""
        key = tuple(table.data_ptr() for table in tables)
        if key != self._table_key or self._entries is None:
            self._entries, self._word = state_tensor_table(self.groups, tables, self.conv_tensors)
            self._table_key = key
        return self._entries


def apply_settle_move(
    tensors: list[torch.Tensor], conv_tensors: frozenset[int], row: list[int], move: SettleMove
) -> None:
    """One settle move with tensor copies (the CPU path, and the tests' reference): the
    temporal state from position ``running + token``, a conv window from ``running``
    starting at token row ``token`` (dim 1 of a conv tensor is the token row)."""
    dst = row[move.dst]
    for tensor in tensors:
        if id(tensor) in conv_tensors:
            window = tensor[row[move.running], move.token :].clone()
            tensor[dst, : window.shape[0]] = window
        else:
            tensor[dst] = tensor[row[move.running + move.token]].clone()


def conv_state_tensors(
    model: Any, groups: list[tuple[int, LighterMambaSpec, list[torch.Tensor]]]
) -> frozenset[int]:
    """``id()`` of the conv-state tensors, by the model's own per-state copy rules (vLLM's
    ``get_conv_copy_spec`` marks a state that speculative decoding shifts by token rows)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec

    copy_funcs = model.get_mamba_state_copy_func()
    per_layer = len(copy_funcs)
    conv = set()
    for _, _, tensors in groups:
        for index, tensor in enumerate(tensors):
            if copy_funcs[index % per_layer] is get_conv_copy_spec:
                conv.add(id(tensor))
    return frozenset(conv)


def state_tensor_table(
    groups: list[tuple[int, LighterMambaSpec, list[torch.Tensor]]],
    tables: list[torch.Tensor],
    conv_tensors: frozenset[int] = frozenset(),
) -> tuple[torch.Tensor, torch.dtype]:
    """One row per state tensor (``state_copy_triton.FIELDS``), in the widest common word.

    ``conv_tensors``: ``id()`` of the conv-state tensors, laid out ``(block, token row,
    dim)``; speculative decoding moves them by token rows (``spec_settle``)."""
    from vllm_lighter_mamba.ops.state_copy_triton import word_dtype

    rows = []
    for (_, spec, tensors), table in zip(groups, tables, strict=True):
        assert table.dtype == torch.int32 and table.stride(1) == 1, "vLLM block tables are int32 rows"
        for tensor in tensors:
            assert tensor[0].is_contiguous(), "a state block must be contiguous"
            size = tensor.element_size()
            token_row = tensor.stride(1) * size if id(tensor) in conv_tensors else 0
            rows.append(  # FIELDS, in bytes where they count words
                (tensor.data_ptr(), tensor.stride(0) * size, prod(tensor.shape[1:]) * size,
                 table.data_ptr(), table.stride(0), spec.block_size, table.shape[1], token_row)
            )
    word = word_dtype([value for row in rows for value in (*row[:3], row[7])])
    word_size = torch.tensor([], dtype=word).element_size()
    table_rows = [(r[0], r[1] // word_size, r[2] // word_size, *r[3:7], r[7] // word_size) for r in rows]
    device = tables[0].device
    return torch.tensor(table_rows, dtype=torch.int64, device=device), word
