"""vllm.model_executor.models.config: keep Mamba cache mode "none" for our layout."""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.model_executor.models import config as upstream

from vllm_lighter_mamba.config import raise_on_conflicts
from vllm_lighter_mamba.envs import VARIABLE, lighter_mamba_enabled
from vllm_lighter_mamba.patch._util import original, replace_attr

logger = init_logger("vllm.lighter_mamba")


def _verify_and_update_config(cls: Any, vllm_config: Any) -> None:
    if not lighter_mamba_enabled():
        upstream_fn = original(upstream.MambaModelConfig, "verify_and_update_config").__func__
        return upstream_fn(cls, vllm_config)
    raise_on_conflicts(vllm_config)
    cache_config = vllm_config.cache_config
    if cache_config.enable_prefix_caching is None:
        cache_config.enable_prefix_caching = True
    # Finer sub-block hits are align mode's; ours are whole blocks of the cache block size.
    if cache_config.mamba_block_size is None or not cache_config.user_specified_mamba_block_size:
        cache_config.mamba_block_size = cache_config.block_size
    logger.info(
        "%s=1: lighter Mamba cache on for %s: recurrent states cached at block boundaries "
        "(block size is finalized with the attention backend); replaces vLLM's "
        "--mamba-cache-mode align",
        VARIABLE,
        vllm_config.model_config.architecture,
    )


def apply() -> None:
    replace_attr(
        upstream.MambaModelConfig, "verify_and_update_config", classmethod(_verify_and_update_config)
    )
