"""vllm.v1.kv_cache_spec_registry: our manager wherever vLLM would build MambaManager."""

from __future__ import annotations

from typing import Any

from vllm.v1 import kv_cache_spec_registry as upstream
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from vllm_lighter_mamba.envs import lighter_mamba_enabled
from vllm_lighter_mamba.patch._util import original, replace_attr


def _get_manager_class(cls: Any, kvcache_spec: Any) -> Any:
    from vllm_lighter_mamba.v1.core.single_type_kv_cache_manager import LighterMambaManager

    manager = original(upstream.KVCacheSpecRegistry, "get_manager_class").__func__(
        cls, kvcache_spec
    )
    if not lighter_mamba_enabled():
        return manager
    if manager is MambaManager and getattr(kvcache_spec, "mamba_cache_mode", None) == "none":
        return LighterMambaManager
    return manager


def apply() -> None:
    replace_attr(upstream.KVCacheSpecRegistry, "get_manager_class", classmethod(_get_manager_class))
