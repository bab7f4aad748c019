"""The lighter cache's counters, kept per engine in the engine-core process.

They live on the engine's ``BlockPool`` (one per engine, shared by the scheduler and every
KV-cache group's manager), so several engines in one process never mix their counts. The
front end asks for them through vLLM's own engine-core utility channel
(``patch_engine_core`` / ``patch_async_llm``): nothing is written anywhere, and nothing is
computed unless a reader asks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class LighterMambaCounters:
    # Boundary states hashed into the prefix cache (one per boundary, whatever the number
    # of Mamba KV-cache groups).
    states_cached: int = 0
    # Requests that started from a cached boundary state, and the prompt tokens it covered.
    state_hits: int = 0
    state_hit_tokens: int = 0
    # Cached boundary states evicted from the block pool to make room.
    states_evicted: int = 0
    # Boundary states in the pool's prefix cache now (a gauge: cached minus evicted).
    states_held: int = 0
    # Retention policy: states kept for later requests once their request moved on, and
    # states put first in line for eviction instead (a dropped state admitted later, e.g.
    # as the deepest state of a finished request, counts in both).
    states_admitted: int = 0
    states_dropped: int = 0
    # Cached pages evicted, by why they were picked: a second copy of a cached prefix (no hit
    # lost); a state whose attention prefix (or one of its pages) was gone; attention past the
    # deepest cached state on its chain; a dropped state; an admitted state, lowest eviction
    # score first; a page the policy did not pick (vLLM's LRU order: the policy had nothing
    # left, or is off).
    evicted_pages_duplicate_copy: int = 0
    evicted_pages_orphan_state: int = 0
    evicted_pages_attention_past_state: int = 0
    evicted_pages_dropped_state: int = 0
    evicted_pages_unproven_checkpoint: int = 0
    evicted_pages_unproven_continuation: int = 0
    evicted_pages_ranked_state: int = 0
    evicted_pages_lru: int = 0
    # Prompt tokens whose attention KV was cached but that had no Mamba state at that
    # boundary, so they were recomputed (the silent 0%-hit case of vLLM #45238).
    lost_hit_tokens: int = 0
    # The retention policy failed and was switched off for this engine (vLLM's LRU order from
    # then on; v1/core/retention_guard.py).
    retention_failures: int = 0

    def record_admission(self, hit_tokens: int, shared_prefix_boundary: int) -> None:
        if hit_tokens > 0:
            self.state_hits += 1
            self.state_hit_tokens += hit_tokens
        self.lost_hit_tokens += max(shared_prefix_boundary - hit_tokens, 0)

    def record_eviction(self, reason: str) -> None:
        name = f"evicted_pages_{reason}"
        setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Values that go up and down (exported as gauges); every other field only grows.
GAUGE_NAMES = ("states_held",)
COUNTER_NAMES = tuple(f.name for f in fields(LighterMambaCounters) if f.name not in GAUGE_NAMES)
_ATTR = "_lighter_mamba_counters"


def engine_counters(block_pool: Any) -> LighterMambaCounters:
    """The counters of the engine that owns ``block_pool`` (created on first use)."""
    counters = getattr(block_pool, _ATTR, None)
    if counters is None:
        counters = LighterMambaCounters()
        setattr(block_pool, _ATTR, counters)
    return counters
