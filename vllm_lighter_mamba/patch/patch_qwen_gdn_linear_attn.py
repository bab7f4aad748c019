"""vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn: the layer's forward exports its
boundary states (internal checkpoints) once FLA has computed them."""

from __future__ import annotations

import functools
from typing import Any

from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as upstream

from vllm_lighter_mamba.model_executor.layers.mamba.checkpoint import PENDING, PLAN_ATTR, PendingExport
from vllm_lighter_mamba.patch._util import original, replace_attr


def _wrap_forward_core(forward_core: Any) -> Any:
    @functools.wraps(forward_core)
    def _forward_core(self: Any, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> Any:
        metadata = upstream.get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        plan = getattr(metadata, PLAN_ATTR, None)
        if plan is None:
            return forward_core(self, mixed_qkv, b, a, core_attn_out)
        kv_cache = self.kv_cache
        conv_state = kv_cache[0] if upstream.is_conv_state_dim_first() else kv_cache[0].transpose(-1, -2)
        pending = PendingExport(
            plan,
            raw_qkv=mixed_qkv[: metadata.num_actual_tokens],
            conv_state=conv_state,
            ssm_state=kv_cache[1],
            state_len=self.conv_kernel_size - 1,
        )
        token = PENDING.set(pending)
        try:
            result = forward_core(self, mixed_qkv, b, a, core_attn_out)
        finally:
            PENDING.reset(token)
        if not pending.done:  # the blocks reserved for the states would be cached unwritten
            raise RuntimeError(
                "lighter Mamba cache: a GDN prefill with internal checkpoints did not run FLA's "
                "chunked kernel; its boundary states were not written"
            )
        return result

    return _forward_core


def apply() -> None:
    cls = upstream.QwenGatedDeltaNetAttention
    replace_attr(cls, "_forward_core", _wrap_forward_core(original(cls, "_forward_core")))
