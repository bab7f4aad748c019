"""vllm.model_executor.layers.mamba.abstract: Mamba layers declare the lighter spec."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.mamba import abstract as upstream
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_lighter_mamba.config import is_active
from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec


def _get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
    spec = original(upstream.MambaBase, "get_kv_cache_spec")(self, vllm_config)
    if is_active(vllm_config) and type(spec) is MambaSpec:
        return LighterMambaSpec.from_mamba_spec(spec)
    return spec


def apply() -> None:
    replace_attr(upstream.MambaBase, "get_kv_cache_spec", _get_kv_cache_spec)
