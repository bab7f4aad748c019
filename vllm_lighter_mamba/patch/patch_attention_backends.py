"""vllm.v1.attention.backends.{gdn_attn, mamba_attn, linear_attn, short_conv_attn}: state indices from our
gather kernel, in every builder module that imports ``mamba_get_block_table_tensor``.

Each of these modules imports the function by name, so the name is rebound in each; a test
scans vLLM's sources for importers and fails on any module missing here.

The same modules' builders may reuse one KV-cache group's metadata for the next group with
``update_block_table``, which re-reads state indices from that group's raw block table in
upstream's layout (the running block in column 0). The GDN builder keeps that reuse for our
spec: its ``update_block_table`` is given the group's gathered indices (one gather launch)
instead of the raw table, so a step builds the GDN metadata once, not once per GDN group
(Qwen3-Next-80B: 3 groups). Every other builder of our spec builds per group.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from vllm_lighter_mamba.model_executor.layers.mamba.checkpoint import (
    PLAN_ATTR,
    CheckpointPlan,
    plan_checkpoints,
)
from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.attention.backends.utils import lighter_mamba_block_table_tensor
from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec

FUNCTION = "mamba_get_block_table_tensor"
# ``mamba_attn`` serves the Mamba1 and Mamba2 builders; short-conv has its own module since
# vLLM 0.32.
BUILDER_MODULES = (
    "vllm.v1.attention.backends.gdn_attn",
    "vllm.v1.attention.backends.mamba_attn",
    "vllm.v1.attention.backends.linear_attn",
    "vllm.v1.attention.backends.short_conv_attn",
)


def builder_classes() -> list[type]:
    """The metadata builder classes of ``BUILDER_MODULES`` that have a constructor of their own."""
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    found = []
    for name in BUILDER_MODULES:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (cls.__module__ == name and issubclass(cls, AttentionMetadataBuilder)
                    and "__init__" in cls.__dict__):
                found.append(cls)
    return found


# The builder whose metadata reuse is kept for our spec (its ``update_block_table`` gets the
# gathered indices); every other builder of our spec builds per group.
REUSING_BUILDER = ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder")
# Set on the metadata a reusing builder built: the step's seq_lens, which the next group's
# ``update_block_table`` needs for its gather (vLLM's GDN metadata does not keep them).
SEQ_LENS_ATTR = "lighter_mamba_seq_lens"


def _ours(builder: Any) -> bool:
    return isinstance(getattr(builder, "kv_cache_spec", None), LighterMambaSpec)


def _is_reusing_builder(cls: type) -> bool:
    return (cls.__module__, cls.__qualname__) == REUSING_BUILDER


def _wrap_builder_init(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # Upstream keeps the GDN reuse off for subclasses (KDA) and on the CPU; so do we.
        if _ours(self) and not _is_reusing_builder(type(self)):
            self.supports_update_block_table = False

    return __init__


def _wrap_build(build: Any) -> Any:
    @functools.wraps(build)
    def build_wrapper(self: Any, common_prefix_len: int, common_attn_metadata: Any,
                      *args: Any, **kwargs: Any) -> Any:
        metadata = build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        if _ours(self):
            setattr(metadata, SEQ_LENS_ATTR, common_attn_metadata.seq_lens)
            setattr(metadata, PLAN_ATTR, _checkpoint_plan(self.kv_cache_spec, metadata, common_attn_metadata))
        return metadata

    return build_wrapper


def _checkpoint_plan(spec: LighterMambaSpec, metadata: Any, m: Any) -> CheckpointPlan | None:
    """The step's internal checkpoints (``model_executor/layers/mamba/checkpoint.py``), where
    this group's layers write them: prefill rows, no drafts (the spec says so: the workers set
    the alignment only without them)."""
    alignment = spec.prefill_checkpoint_alignment
    if alignment is None or metadata.num_prefills == 0 or metadata.spec_sequence_masks is not None:
        return None
    # Host copies vLLM's builders read too (no device read); a row in prefill is exact there.
    seq_lens = m.seq_lens_cpu_upper_bound
    if seq_lens is None:  # blocks reserved for checkpoints would stay unwritten: never guess
        raise RuntimeError("lighter Mamba cache: GDN metadata without host seq_lens for checkpoints")
    plan = plan_checkpoints(
        m.query_start_loc_cpu.tolist(), seq_lens.tolist(), metadata.num_decodes,
        metadata.num_prefills, spec.block_size, alignment,
    )
    return CheckpointPlan.build(plan, m.block_table_tensor)


def _wrap_update_block_table(update: Any) -> Any:
    @functools.wraps(update)
    def update_block_table(self: Any, metadata: Any, blk_table: Any, slot_mapping: Any) -> Any:
        if not _ours(self):
            return update(self, metadata, blk_table, slot_mapping)
        seq_lens = getattr(metadata, SEQ_LENS_ATTR, None)
        if seq_lens is None:  # not built by a builder of our spec: never guess the layout
            raise RuntimeError("lighter Mamba cache: GDN metadata reused without its seq_lens")
        # Upstream's reuse reads column 0 (+ spec columns) of what it is given: the builders'
        # lookup puts this group's running block there, as its own build would.
        indices = lighter_mamba_block_table_tensor(
            blk_table, seq_lens, self.kv_cache_spec, self.vllm_config.cache_config.mamba_cache_mode)
        updated = update(self, metadata, indices, slot_mapping)
        setattr(updated, SEQ_LENS_ATTR, seq_lens)
        plan = getattr(metadata, PLAN_ATTR, None)
        setattr(updated, PLAN_ATTR, plan.regather(blk_table) if plan is not None else None)
        return updated

    return update_block_table


def apply() -> None:
    for name in BUILDER_MODULES:
        replace_attr(importlib.import_module(name), FUNCTION, lighter_mamba_block_table_tensor)
    for cls in builder_classes():
        replace_attr(cls, "__init__", _wrap_builder_init(original(cls, "__init__")))
        if _is_reusing_builder(cls):
            replace_attr(cls, "build", _wrap_build(original(cls, "build")))
            replace_attr(cls, "update_block_table",
                         _wrap_update_block_table(original(cls, "update_block_table")))
