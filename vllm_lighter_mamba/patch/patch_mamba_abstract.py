"""vllm.model_executor.layers.mamba.abstract: Mamba layers declare the lighter spec."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vllm.model_executor.layers.mamba import abstract as upstream
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_lighter_mamba.config import is_active
from vllm_lighter_mamba.model_executor.layers.mamba.checkpoint import checkpoint_alignment
from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec


def _get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
    spec = original(upstream.MambaBase, "get_kv_cache_spec")(self, vllm_config)
    if is_active(vllm_config) and type(spec) is MambaSpec:
        spec = LighterMambaSpec.from_mamba_spec(spec)
        # Where this layer writes boundary states inside its forward, the spec says on which
        # grid (vLLM's own field for it, read by our scheduler and manager).
        alignment = checkpoint_alignment(self, vllm_config, spec.dtypes[-1])
        return replace(spec, prefill_checkpoint_alignment=alignment) if alignment else spec
    return spec


def apply() -> None:
    replace_attr(upstream.MambaBase, "get_kv_cache_spec", _get_kv_cache_spec)
