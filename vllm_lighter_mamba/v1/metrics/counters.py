"""Lighter-cache counters, counted in the engine-core process and published to the front end.

vLLM's ``SchedulerStats`` has no field a plugin can extend (msgspec drops unknown fields on
the way to the front end), so the engine core writes its counters, at most once a second, to
a small JSON file in a directory named after the front-end process (the engine core's
parent); the front end's stat logger reads it and feeds Prometheus.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class LighterMambaCounters:
    # Mamba boundary states hashed into the prefix cache.
    states_cached: int = 0
    # Requests that started from a cached boundary state, and the prompt tokens it covered.
    state_hits: int = 0
    state_hit_tokens: int = 0
    # Cached boundary states evicted from the block pool to make room.
    states_evicted: int = 0
    # Prompt tokens whose attention KV was cached but that had no Mamba state at that
    # boundary, so they were recomputed (the silent 0%-hit case of vLLM #45238).
    lost_hit_tokens: int = 0


COUNTERS = LighterMambaCounters()
# KV-cache group ids of the Mamba-type groups in this process (set by the managers).
MAMBA_GROUP_IDS: set[int] = set()

_PUBLISH_INTERVAL_S = 1.0
_last_publish = 0.0


def channel_dir(frontend_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"vllm-lighter-mamba-{frontend_pid}"


def publish(engine_index: int = 0, force: bool = False) -> None:
    """Engine core: write the counters for the front end (rate-limited, atomic)."""
    global _last_publish
    now = time.monotonic()
    if not force and now - _last_publish < _PUBLISH_INTERVAL_S:
        return
    _last_publish = now
    directory = channel_dir(os.getppid())
    directory.mkdir(exist_ok=True)
    target = directory / f"engine-{engine_index}.json"
    temporary = target.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(asdict(COUNTERS)))
    os.replace(temporary, target)


def read_published(frontend_pid: int) -> LighterMambaCounters:
    """Front end: the engine cores' counters, summed (zeros before the first publish)."""
    total = LighterMambaCounters()
    directory = channel_dir(frontend_pid)
    if not directory.is_dir():
        return total
    for path in directory.glob("engine-*.json"):
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now: read again next time
        for name, value in values.items():
            setattr(total, name, getattr(total, name) + int(value))
    return total
