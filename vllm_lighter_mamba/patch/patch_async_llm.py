"""vllm.v1.engine.async_llm: add the lighter cache's stat logger (front end, serving)."""

from __future__ import annotations

from vllm.v1.engine import async_llm as upstream

from vllm_lighter_mamba.envs import lighter_mamba_enabled
from vllm_lighter_mamba.patch._util import original, replace_attr


def _load_stat_logger_plugin_factories() -> list:
    factories = list(original(upstream, "load_stat_logger_plugin_factories")())
    if lighter_mamba_enabled():
        from vllm_lighter_mamba.v1.metrics.stat_logger import LighterMambaStatLogger

        factories.append(LighterMambaStatLogger)
    return factories


def apply() -> None:
    replace_attr(upstream, "load_stat_logger_plugin_factories", _load_stat_logger_plugin_factories)
