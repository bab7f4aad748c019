"""Start-up rules of the lighter cache: pure checks, one clear error each."""

from __future__ import annotations

from typing import Any

from vllm_lighter_mamba.envs import VARIABLE, LighterMambaConfigError


def config_conflicts(vllm_config: Any) -> list[str]:
    """Settings of a hybrid (Mamba-type) model that the lighter cache cannot honour."""
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    problems = []
    if cache.mamba_cache_mode != "none":
        problems.append(
            f"--mamba-cache-mode {cache.mamba_cache_mode} was given, but the lighter cache "
            f"replaces vLLM's Mamba cache modes: drop the flag or unset {VARIABLE}"
        )
    if cache.enable_prefix_caching is False:
        problems.append(
            f"prefix caching is disabled (--no-enable-prefix-caching), so the lighter cache "
            f"has nothing to do: enable prefix caching or unset {VARIABLE}"
        )
    if not sched.enable_chunked_prefill:
        problems.append(
            "chunked prefill is disabled, but prefill chunks must end on block boundaries: "
            "enable chunked prefill"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism is not supported with the lighter cache")
    if vllm_config.speculative_config is not None:
        problems.append(
            "speculative decoding is not supported yet: its accepted-token state copies "
            "are not implemented by the lighter cache"
        )
    if vllm_config.kv_transfer_config is not None:
        problems.append("KV connectors (kv_transfer_config) are not supported yet")
    return problems


def check_block_size(block_size: int, max_num_batched_tokens: int) -> None:
    """A token budget below one block could never schedule an aligned chunk."""
    if max_num_batched_tokens < block_size:
        raise LighterMambaConfigError(
            f"{VARIABLE}=1 needs max_num_batched_tokens ({max_num_batched_tokens}) >= the "
            f"block size ({block_size}): a prefill chunk must cover at least one block"
        )


def raise_on_conflicts(vllm_config: Any) -> None:
    problems = config_conflicts(vllm_config)
    if problems:
        raise LighterMambaConfigError(f"{VARIABLE}=1: " + "; ".join(problems))


def lighter_layout_active(cache_config: Any) -> bool:
    """Whether Mamba groups use our position-indexed layout in this process.

    With the variable on, the start-up check leaves ``mamba_cache_mode`` at ``"none"`` while
    prefix caching is on; upstream never runs in that combination for hybrid models.
    """
    from vllm_lighter_mamba.envs import lighter_mamba_enabled

    return (
        lighter_mamba_enabled()
        and bool(cache_config.enable_prefix_caching)
        and cache_config.mamba_cache_mode == "none"
    )
