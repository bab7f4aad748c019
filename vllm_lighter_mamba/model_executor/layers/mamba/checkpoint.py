"""Boundary states written inside the forward (internal checkpoints) on the Triton GDN prefill.

Without this, the lighter cache keeps the state at a prefill's last cache position by ending a
chunk there: a chat turn then takes two prefill steps, and on the 80B-shaped model a prefill
step costs ~150 ms whatever its length (docs/benchmarks.md, 2026-12-06). vLLM's Triton GDN
prefill (FLA's chunked kernels) already computes the state before every 64-token chunk of every
row (``h``, in the model dtype) and drops it; the state at a boundary 64-aligned from the row's
start is one row of ``h``, bitwise what a chunk ending there stores in a cache of the model dtype
(tests/kernels/test_gdn_boundary_states.py, H100, 2026-12-06).

Three pieces, each keyed on the one rule of ``policy.internal_checkpoint`` (vLLM's own
``compute_mamba_prefill_checkpoints`` here, which applies the same two vLLM functions per row):

- :func:`plan_checkpoints`: per step, on the host, which rows of the GDN metadata have a
  checkpoint, its offset, its block-table column and its row of ``h`` (pure);
- :class:`CheckpointPlan`: that plan on the device, with this KV-cache group's block ids
  (gathered on the device: no host read of the block table) and a regather for the next group;
- :class:`PendingExport`: set around one layer's ``_forward_core`` and run by the wrapper of
  FLA's ``chunk_gated_delta_rule_fwd_h`` once ``h`` exists: vLLM's
  ``MambaPrefillCheckpointExporter`` stores the raw conv window and the ``h`` row into each
  checkpoint's block (one launch; a null block id, where the manager kept none, is skipped).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.model_executor.layers.mamba.checkpoint import (
    MambaPrefillCheckpointMetadata,
    compute_mamba_prefill_checkpoints,
)
from vllm.utils.math_utils import cdiv

# FLA's chunk (``FLA_CHUNK_SIZE``; a unit test checks the two agree): rows of ``h`` are 64 tokens
# apart from each row's start, so this is the grid a checkpoint offset must lie on.
FLA_CHUNK = 64


@dataclass(frozen=True)
class HostPlan:
    """Per checkpoint (one per row at most): the row, the block-table column of its block, its
    offset into the row's query, the row's first token in the step's input, its row of ``h``."""

    rows: list[int]
    cols: list[int]
    offsets: list[int]
    token_starts: list[int]
    h_rows: list[int]


def plan_checkpoints(
    query_start_loc: list[int],
    seq_lens: list[int],
    num_decodes: int,
    num_prefills: int,
    block_size: int,
    alignment: int,
    chunk: int = FLA_CHUNK,
) -> HostPlan:
    """Which rows of a step write a checkpoint inside the forward, and where.

    ``query_start_loc`` / ``seq_lens``: the step's rows as the GDN builder sees them (decodes
    first; without drafts, its prefill kernel runs rows ``num_decodes .. num_decodes +
    num_prefills`` and its ``h`` lists their 64-token chunks in that order). A row's checkpoint
    is vLLM's rule with the whole block as the hash grid (``compute_mamba_prefill_checkpoints``):
    the manager reserved a block at that column only for the chunk that reaches the prefill end;
    anywhere else the column holds this step's null padding and the export skips it.
    ``chunk``: the prefill kernel's chunk (rows of ``h``; FLA's, a divisor of ``alignment``).
    """
    prefill = range(num_decodes, num_decodes + num_prefills)
    query_lens = [query_start_loc[r + 1] - query_start_loc[r] for r in prefill]
    offsets, cols = compute_mamba_prefill_checkpoints(
        [seq_lens[r] for r in prefill],
        query_lens,
        hash_block_size=block_size,
        mamba_block_size=block_size,
        checkpoint_alignment=alignment,
        drop_eagle_block=False,
        cache_hit_alignment_tokens=block_size,
    )
    plan = HostPlan([], [], [], [], [])
    first_chunk = 0  # this row's first row of ``h``
    for row, query_len, offset, col in zip(prefill, query_lens, offsets, cols, strict=True):
        if offset > 0:
            assert offset % chunk == 0, (offset, chunk)  # vLLM's rule keeps it on the alignment
            plan.rows.append(row)
            plan.cols.append(col)
            plan.offsets.append(offset)
            plan.token_starts.append(query_start_loc[row])
            plan.h_rows.append(first_chunk + offset // chunk)
        first_chunk += cdiv(query_len, chunk)
    return plan


@dataclass
class CheckpointPlan:
    """A step's checkpoints on the device, with one KV-cache group's block ids."""

    checkpoint: MambaPrefillCheckpointMetadata  # offsets, block ids, rows and columns
    token_starts: torch.Tensor  # int32, per checkpoint
    h_rows: torch.Tensor  # int64, per checkpoint

    @classmethod
    def build(cls, plan: HostPlan, block_table: torch.Tensor) -> CheckpointPlan | None:
        if not plan.rows:
            return None
        n = len(plan.rows)
        # One host-to-device copy (pinned, asynchronous); the block ids are read on the device.
        packed = torch.tensor(
            plan.offsets + plan.token_starts + plan.rows + plan.cols + plan.h_rows,
            dtype=torch.int64, pin_memory=block_table.is_cuda,
        ).to(block_table.device, non_blocking=True)
        offsets, starts, rows, cols, h_rows = packed.split(n)
        checkpoint = MambaPrefillCheckpointMetadata(
            checkpoint_offsets=offsets.to(torch.int32),
            state_indices=block_table[rows, cols],
            offsets=plan.offsets,
            request_rows=rows,
            block_cols=cols,
        )
        return cls(checkpoint, starts.to(torch.int32), h_rows)

    def regather(self, block_table: torch.Tensor) -> CheckpointPlan:
        """The same checkpoints with another KV-cache group's block ids (its raw table)."""
        checkpoint = self.checkpoint.regather_state_indices(block_table)
        return CheckpointPlan(checkpoint, self.token_starts, self.h_rows)


@dataclass
class PendingExport:
    """One layer's checkpoints, waiting for FLA's ``h`` inside that layer's forward."""

    plan: CheckpointPlan
    raw_qkv: torch.Tensor  # the step's pre-convolution input, (tokens, conv dim)
    conv_state: torch.Tensor  # (blocks, conv dim, width - 1)
    ssm_state: torch.Tensor  # (blocks, heads, v, k)
    state_len: int  # width - 1
    done: bool = field(default=False)

    def export(self, h: torch.Tensor) -> None:
        from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointExporter

        if self.done:
            raise RuntimeError("lighter Mamba cache: a second FLA prefill in one layer's forward")
        if h.dtype != self.ssm_state.dtype:  # the workers enable checkpoints only where they agree
            raise RuntimeError(
                f"lighter Mamba cache: FLA states in {h.dtype}, the cache in {self.ssm_state.dtype}"
            )
        MambaPrefillCheckpointExporter(state_len=self.state_len).export(
            self.plan.checkpoint,
            raw_qkv=self.raw_qkv,
            conv_state=self.conv_state,
            cu_seqlens=self.plan.token_starts,
            recurrent_checkpoint=h[0],
            recurrent_state=self.ssm_state,
            recurrent_rows=self.plan.h_rows,
        )
        self.done = True


# Set by the GDN builder wrapper (``patch_attention_backends``) on the metadata of a step with
# checkpoints, read by the layer's ``_forward_core`` wrapper: a ``CheckpointPlan`` with this
# group's block ids.
PLAN_ATTR = "lighter_mamba_checkpoints"


# The export of the layer whose ``_forward_core`` is running (its prefill runs eagerly: the GDN
# core is a splitting op of vLLM's compiled graph).
PENDING: contextvars.ContextVar[PendingExport | None] = contextvars.ContextVar(
    "lighter_mamba_pending_export", default=None
)


def export_pending(h: Any) -> None:
    """Called with FLA's ``h`` by the wrapper of ``chunk_gated_delta_rule_fwd_h``; other
    callers of FLA (no layer of ours running) pass through."""
    pending = PENDING.get()
    if pending is not None:
        pending.export(h)


def checkpoint_alignment(layer: Any, vllm_config: Any, ssm_dtype: torch.dtype) -> int | None:
    """The grid on which this layer writes boundary states inside its forward, or None.

    Only where the state written is exactly what a chunk end would leave: the engine allows it
    (:func:`may_write_checkpoints`: CUDA, the Triton GDN prefill, no drafts, not turned off), the
    layer is a Qwen GDN layer of upstream's forward (a subclass with its own ``_forward_core`` is
    not ours to hook) whose prefill runs FLA's Triton kernels (``h`` exists; FlashInfer's path
    has no ``h``), and its SSM cache is in the model dtype (``h`` is in the model dtype; a float32
    cache would get rounded states, which caching off does not have).
    """
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    eligible = (
        may_write_checkpoints(vllm_config)
        and isinstance(layer, QwenGatedDeltaNetAttention)
        and type(layer)._forward_core is QwenGatedDeltaNetAttention._forward_core
        and getattr(layer, "gdn_prefill_backend", None) == "triton"
        and ssm_dtype == vllm_config.model_config.dtype
    )
    return FLA_CHUNK if eligible else None


def may_write_checkpoints(vllm_config: Any) -> bool:
    """Whether this engine's GDN layers may write checkpoints inside the forward (the platform
    asks before any layer exists, to put the block size on FLA's grid; each layer then asks
    :func:`checkpoint_alignment`): a GDN model on CUDA whose prefill resolves to the Triton
    kernels, without drafts (their speculative blocks move between steps; the cut stays), not
    turned off (``config.INTERNAL_CHECKPOINTS_KEY``)."""
    from vllm.platforms import current_platform

    from vllm_lighter_mamba.config import internal_checkpoints

    if not (
        internal_checkpoints(vllm_config)
        and current_platform.is_cuda()
        and vllm_config.speculative_config is None
        and getattr(vllm_config.model_config.hf_text_config, "linear_key_head_dim", None) is not None
    ):
        return False
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import _resolve_gdn_prefill_backend

    return _resolve_gdn_prefill_backend(vllm_config)[1] == "triton"
