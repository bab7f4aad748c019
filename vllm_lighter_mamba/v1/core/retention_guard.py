"""One guard for every call into the state retention policy (``block_pool_retention``).

The policy only chooses which cached blocks vLLM's pool evicts first; vLLM's LRU order is
always a correct fallback. So a failure in its bookkeeping, at any entry point (pool side:
before an allocation, after a free or an eviction; manager side: a lookup, a state cached, a
hit, a request released), never reaches the engine: the policy is switched off for that pool, one
log line says so, and the ``retention_failures`` counter (``/metrics``) counts it. With
``LIGHTER_MAMBA_RETENTION_STRICT=1`` (the test suite) the error is raised instead, so a
bookkeeping bug fails the test that hit it rather than quietly turning the policy off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from vllm.logger import init_logger

from vllm_lighter_mamba.v1.core.block_pool_retention import StateRetention, remove_retention, retention_of
from vllm_lighter_mamba.v1.metrics.counters import engine_counters

STRICT_VARIABLE = "LIGHTER_MAMBA_RETENTION_STRICT"
T = TypeVar("T")
logger = init_logger("vllm.lighter_mamba")


def strict() -> bool:
    return os.environ.get(STRICT_VARIABLE, "0") == "1"


def with_retention(pool: Any, entry: str, call: Callable[[StateRetention], T], default: T) -> T:
    """``call(policy)`` if ``pool`` has a retention policy, else ``default``; a failure
    switches the policy off and returns ``default`` (or raises in strict mode)."""
    retention = retention_of(pool)
    if retention is None:
        return default
    try:
        return call(retention)
    except Exception as error:
        if strict():
            raise
        policy_failed(pool, entry, error)
        return default


def policy_failed(pool: Any, entry: str, error: BaseException) -> None:
    remove_retention(pool)
    engine_counters(pool).retention_failures += 1
    logger.exception(
        "lighter Mamba cache: the state retention policy failed in %s (%r); this engine "
        "continues with vLLM's LRU eviction order",
        entry,
        error,
    )
