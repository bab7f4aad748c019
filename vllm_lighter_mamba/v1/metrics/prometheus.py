"""Front end: the lighter cache's counters on ``/metrics`` as ``vllm:lighter_mamba_*_total``
(and its gauges as ``vllm:lighter_mamba_*``).

Pulled from each engine core through vLLM's utility channel whenever vLLM logs its stats
(``AsyncLLM.do_log_stats``, every ``VLLM_LOG_STATS_INTERVAL`` seconds; so not with
``--disable-log-stats``). A failed or slow pull is skipped; it never reaches the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import Counter, Gauge
from vllm.logger import init_logger

from vllm_lighter_mamba.v1.metrics.counters import COUNTER_NAMES, GAUGE_NAMES

logger = init_logger("vllm.lighter_mamba")

UTILITY_METHOD = "lighter_mamba_counters"
PULL_TIMEOUT_S = 5.0
DOCS = {
    "states_cached": "Mamba boundary states cached by the lighter Mamba cache",
    "state_hits": "Requests that started from a cached Mamba boundary state",
    "state_hit_tokens": "Prompt tokens covered by cached Mamba boundary states",
    "states_evicted": "Cached Mamba boundary states evicted from the block pool",
    "lost_hit_tokens": "Prompt tokens with cached attention KV but no Mamba state at that "
    "boundary (recomputed)",
    "states_held": "Mamba boundary states in the prefix cache now",
    "retention_failures": "Times the retention policy failed and was switched off (LRU order since)",
    "states_admitted": "Boundary states kept for later requests once their request moved on",
    "states_dropped": "Boundary states put first in line for eviction (no later request expected "
    "to resume from them)",
    "evicted_pages_duplicate_copy": "Cached pages evicted: a copy of a prefix another block still holds",
    "evicted_pages_orphan_state": "Cached pages evicted: a state whose attention prefix was gone",
    "evicted_pages_attention_past_state": "Cached pages evicted: attention past the deepest cached "
    "state on its chain",
    "evicted_pages_dropped_state": "Cached pages evicted: a dropped state",
    "evicted_pages_unproven_checkpoint": "Cached pages evicted: a cold-prompt checkpoint nobody resumed "
    "from yet, beyond their share of the pool",
    "evicted_pages_unproven_continuation": "Cached pages evicted: a decode end no next turn resumed "
    "from yet, beyond their share of the pool",
    "evicted_pages_ranked_state": "Cached pages evicted: an admitted state, lowest recency + "
    "utility score first",
    "evicted_pages_lru": "Cached pages evicted in vLLM's LRU order (not picked by the policy)",
}
_prometheus: dict[str, Counter] = {}
_gauges: dict[str, Gauge] = {}


def prometheus_counters() -> dict[str, Counter]:
    """One set per process, labelled by engine.

    Created on first use, not at import: vLLM's Prometheus logger unregisters every
    ``vllm:``-prefixed collector when it is constructed.
    """
    if not _prometheus:
        for name in COUNTER_NAMES:
            _prometheus[name] = Counter(f"vllm:lighter_mamba_{name}", DOCS[name], ["engine"])
    return _prometheus


def prometheus_gauges() -> dict[str, Gauge]:
    """As :func:`prometheus_counters`, for the values that go up and down."""
    if not _gauges:
        for name in GAUGE_NAMES:
            _gauges[name] = Gauge(f"vllm:lighter_mamba_{name}", DOCS[name], ["engine"])
    return _gauges


class LighterMambaMetrics:
    """What the front end has already exported, per engine."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, int]] = {}

    def export(self, engine_index: int, values: dict[str, int]) -> bool:
        """Move the engine's Prometheus counters up to ``values``; True if anything moved."""
        seen = self.seen.setdefault(engine_index, dict.fromkeys(COUNTER_NAMES, 0))
        counters = prometheus_counters()
        moved = False
        for name in COUNTER_NAMES:
            child = counters[name].labels(engine=str(engine_index))  # listed from the start, at 0
            delta = int(values.get(name, 0)) - seen[name]
            if delta > 0:
                child.inc(delta)
                seen[name] += delta
                moved = True
        for name, gauge in prometheus_gauges().items():
            gauge.labels(engine=str(engine_index)).set(int(values.get(name, 0)))
        return moved

    async def refresh(self, engine_client: Any) -> None:
        """Pull every engine's counters; never raises."""
        try:
            engines = list(getattr(engine_client, "core_engines", None) or [])
            results = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        engine_client._call_utility_async(UTILITY_METHOD, engine=engine)
                        for engine in engines
                    )
                ),
                timeout=PULL_TIMEOUT_S,
            )
        except Exception as error:  # a busy or stopping engine: try again next interval
            logger.debug("lighter Mamba cache: counters not pulled (%r)", error)
            return
        moved = False
        for engine, values in zip(engines, results, strict=True):
            if isinstance(values, dict):
                moved |= self.export(int.from_bytes(engine, "little"), values)
        if moved:
            totals = {name: sum(s[name] for s in self.seen.values()) for name in COUNTER_NAMES}
            logger.info(
                "lighter Mamba cache: %s", ", ".join(f"{k}={v}" for k, v in totals.items())
            )
