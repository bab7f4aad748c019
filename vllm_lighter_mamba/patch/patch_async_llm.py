"""vllm.v1.engine.async_llm: pull the lighter counters when vLLM logs its stats (serving)."""

from __future__ import annotations

from typing import Any

from vllm.v1.engine import async_llm as upstream

from vllm_lighter_mamba.config import is_active
from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.metrics.prometheus import LighterMambaMetrics


async def _do_log_stats(self: Any) -> None:
    if self.logger_manager and is_active(self.vllm_config):
        metrics = self.__dict__.setdefault("_lighter_mamba_metrics", LighterMambaMetrics())
        await metrics.refresh(self.engine_core)
    await original(upstream.AsyncLLM, "do_log_stats")(self)


def apply() -> None:
    replace_attr(upstream.AsyncLLM, "do_log_stats", _do_log_stats)
