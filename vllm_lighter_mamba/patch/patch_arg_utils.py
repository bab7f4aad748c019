"""vllm.engine.arg_utils: prefix caching defaults to on for hybrid models with the variable on."""

from __future__ import annotations

from typing import Any

from vllm.engine import arg_utils as upstream
from vllm.logger import init_logger

from vllm_lighter_mamba.envs import VARIABLE, LighterMambaConfigError, lighter_mamba_enabled
from vllm_lighter_mamba.patch._util import original, replace_attr

logger = init_logger("vllm.lighter_mamba")


def _set_defaults(self: Any, model_config: Any) -> None:
    if lighter_mamba_enabled() and model_config.is_hybrid:
        if self.enable_prefix_caching is False:
            raise LighterMambaConfigError(
                f"{VARIABLE}=1 but prefix caching is explicitly disabled "
                f"(--no-enable-prefix-caching / enable_prefix_caching=False): the lighter cache "
                f"is a prefix cache; enable prefix caching or unset {VARIABLE}"
            )
        # vLLM 0.26 keeps prefix caching opt-in for hybrid models; the variable opts in.
        self.enable_prefix_caching = True
    elif lighter_mamba_enabled():
        logger.info(
            "%s=1, but %s has no Mamba-type layers: the lighter Mamba cache changes nothing",
            VARIABLE,
            model_config.architecture,
        )
    name = "_set_default_chunked_prefill_and_prefix_caching_args"
    original(upstream.EngineArgs, name)(self, model_config)


def apply() -> None:
    replace_attr(
        upstream.EngineArgs, "_set_default_chunked_prefill_and_prefix_caching_args", _set_defaults
    )
