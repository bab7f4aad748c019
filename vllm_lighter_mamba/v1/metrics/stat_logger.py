"""Front-end stat logger: the lighter cache's counters on /metrics and in the log.

Added to vLLM's stat loggers only while the variable is on (``patch_async_llm``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import time
from dataclasses import asdict, fields

from prometheus_client import Counter
from vllm.logger import init_logger
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_lighter_mamba.v1.metrics.counters import LighterMambaCounters, channel_dir, read_published

logger = init_logger("vllm.lighter_mamba")

DOCS = {
    "states_cached": "Mamba boundary states cached by the lighter Mamba cache",
    "state_hits": "Requests that started from a cached Mamba boundary state",
    "state_hit_tokens": "Prompt tokens covered by cached Mamba boundary states",
    "states_evicted": "Cached Mamba boundary states evicted from the block pool",
    "lost_hit_tokens": "Prompt tokens with cached attention KV but no Mamba state at that "
    "boundary (recomputed)",
}
_prometheus: dict[str, Counter] = {}


def prometheus_counters() -> dict[str, Counter]:
    """One set per process (several engines share it).

    Created on first use, not in ``__init__``: vLLM's Prometheus logger unregisters every
    ``vllm:``-prefixed collector when it is constructed, possibly after ours.
    """
    if not _prometheus:
        for f in fields(LighterMambaCounters):
            _prometheus[f.name] = Counter(f"vllm:lighter_mamba_{f.name}", DOCS[f.name])
    return _prometheus


class LighterMambaStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        self.seen = LighterMambaCounters()
        self.last_read = 0.0
        atexit.register(shutil.rmtree, channel_dir(os.getpid()), ignore_errors=True)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        now = time.monotonic()
        if now - self.last_read < 1.0:
            return
        self.last_read = now
        self.refresh()

    def refresh(self) -> LighterMambaCounters:
        """Move the Prometheus counters up to the published values."""
        published = read_published(os.getpid())
        counters = prometheus_counters()
        for name, value in asdict(published).items():
            delta = value - getattr(self.seen, name)
            if delta > 0:
                counters[name].inc(delta)
        self.seen = published
        return published

    def log(self):
        values = asdict(self.refresh())
        if any(values.values()):
            logger.info("lighter Mamba cache: %s", ", ".join(f"{k}={v}" for k, v in values.items()))

    def log_engine_initialized(self):
        pass
