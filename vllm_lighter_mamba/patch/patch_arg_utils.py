"""vllm.engine.arg_utils: where the lighter cache is switched on, and checked, for one engine."""

from __future__ import annotations

from typing import Any

from vllm.engine import arg_utils as upstream
from vllm.logger import init_logger

from vllm_lighter_mamba.config import is_active, raise_on_conflicts, speculative_shown, with_decision
from vllm_lighter_mamba.envs import VARIABLE, LighterMambaConfigError, requested_by_environment
from vllm_lighter_mamba.patch._util import original, replace_attr

logger = init_logger("vllm.lighter_mamba")

_SET_DEFAULTS = "_set_default_chunked_prefill_and_prefix_caching_args"


def _set_defaults(self: Any, model_config: Any) -> None:
    """The decision: the variable is on and the model mixes attention with Mamba-type layers.

    Runs inside ``create_engine_config`` once the model config exists and before the
    ``VllmConfig`` is built, so every later step (and process) reads the decision from it.
    """
    active = requested_by_environment() and model_config.is_hybrid
    if requested_by_environment() and not active:
        logger.info(
            "%s=1, but %s is not a hybrid attention + Mamba model: the lighter Mamba cache "
            "changes nothing (vLLM runs as without the variable)",
            VARIABLE,
            model_config.architecture,
        )
    if active:
        if self.enable_prefix_caching is False:
            raise LighterMambaConfigError(
                f"{VARIABLE}=1 but prefix caching is explicitly disabled "
                f"(--no-enable-prefix-caching / enable_prefix_caching=False): the lighter cache "
                f"is a prefix cache; enable prefix caching or unset {VARIABLE}"
            )
        # vLLM 0.32 turns it on by default for hybrids; the variable asks for it either way.
        self.enable_prefix_caching = True
    self.additional_config = with_decision(self.additional_config, active)
    original(upstream.EngineArgs, _SET_DEFAULTS)(self, model_config)


def _create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Check the *final* config: some options (``--kv-offloading-size``) are only turned into
    settings at the end of ``VllmConfig.__post_init__``."""
    config = original(upstream.EngineArgs, "create_engine_config")(self, *args, **kwargs)
    if is_active(config):
        raise_on_conflicts(config)
        logger.info(
            "%s=1: lighter Mamba cache on for %s: recurrent states cached at block boundaries "
            "(block size is finalized with the attention backend); replaces vLLM's "
            "--mamba-cache-mode align",
            VARIABLE,
            config.model_config.architecture,
        )
        if config.speculative_config is not None and not speculative_shown(config):
            logger.warning(
                "speculative decoding (%s) with %s and the lighter Mamba cache is experimental: "
                "its outputs are not yet shown equal to prefix caching off on a GPU",
                config.speculative_config.method,
                config.model_config.architecture,
            )
    return config


def apply() -> None:
    replace_attr(upstream.EngineArgs, _SET_DEFAULTS, _set_defaults)
    replace_attr(upstream.EngineArgs, "create_engine_config", _create_engine_config)
