"""vllm.v1.kv_cache_spec_registry: our manager for our spec, through vLLM's own registry."""

from __future__ import annotations

from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_lighter_mamba.v1.core.single_type_kv_cache_manager import LighterMambaManager
from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec


def apply() -> None:
    # vLLM registers its built-in specs lazily, only while the registry is empty: add them
    # first so that ours does not stand alone (re-registering the same entries is allowed).
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(
        LighterMambaSpec, LighterMambaManager, uniform_type_base_spec=MambaSpec
    )
