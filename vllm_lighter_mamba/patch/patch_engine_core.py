"""vllm.v1.engine.core: a utility method that returns the engine's lighter-cache counters."""

from __future__ import annotations

from typing import Any

from vllm.v1.engine import core as upstream

from vllm_lighter_mamba.patch._util import add_attr
from vllm_lighter_mamba.v1.metrics.prometheus import UTILITY_METHOD


def lighter_mamba_counters(self: Any) -> dict[str, int]:
    """Called by the front end through vLLM's utility channel (errors go back to the caller)."""
    counters = getattr(self.scheduler, "lighter_counters", None)
    return counters.as_dict() if counters is not None else {}


def apply() -> None:
    add_attr(upstream.EngineCore, UTILITY_METHOD, lighter_mamba_counters)
