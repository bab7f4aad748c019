"""The lighter cache's counters (exported as vllm:lighter_mamba_* on /metrics)."""

from __future__ import annotations

import os
from dataclasses import asdict

from vllm_lighter_mamba.testing.sim import SimRequest, replay
from vllm_lighter_mamba.v1.metrics import counters
from vllm_lighter_mamba.v1.metrics.counters import COUNTERS, LighterMambaCounters, read_published


def snapshot() -> dict:
    return asdict(COUNTERS)


def delta(before: dict) -> dict:
    return {k: v - before[k] for k, v in asdict(COUNTERS).items()}


def test_cached_hit_and_lost_hit_counts(qwen3_next_dir):
    prefix = list(range(1, 101))
    reqs = [
        # A (cold, last cache position 144): chunks end at 64 (budget 64), then at the
        # checkpoints 80, 112, 128 (4, 2, 1 blocks before 144) and at 144: no state at 96.
        SimRequest("a", prefix + list(range(500, 550)), max_tokens=2),
        # B shares 100 tokens: attention could serve 96, the Mamba state only 80 -> 16 lost.
        SimRequest("b", prefix + [7, 7, 7], max_tokens=2, arrival_step=10),
        # C: B's chunk stopped at the 96 junction, so C gets the full 96.
        SimRequest("c", prefix + [8, 8], max_tokens=2, arrival_step=20),
    ]
    before = snapshot()
    result = replay("lighter", reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    d = delta(before)
    assert result.cached_per_request == {"a": 0, "b": 80, "c": 96}
    assert d["state_hits"] == 2 and d["state_hit_tokens"] == 80 + 96
    assert d["lost_hit_tokens"] == 16
    assert d["states_cached"] >= 6  # 64, 80, 112, 128, 144 (a), 96 (b), and decode-filled blocks


def test_evictions_are_counted(qwen3_next_dir):
    reqs = [SimRequest(f"e{i}", [i + 1] * 200, max_tokens=2, arrival_step=3 * i) for i in range(12)]
    before = snapshot()
    replay("lighter", reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64, num_blocks=60)
    assert delta(before)["states_evicted"] > 0


def test_publish_and_read_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(counters.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(counters, "COUNTERS", LighterMambaCounters(states_cached=3, state_hits=2))
    counters.publish(engine_index=0, force=True)
    counters.COUNTERS.state_hits = 5
    counters.publish(engine_index=1, force=True)
    # The engine core publishes under its parent's pid: read as that parent.
    total = read_published(os.getppid())
    assert total.states_cached == 6 and total.state_hits == 7
    assert read_published(-1) == LighterMambaCounters()


def test_final_counts_are_published_when_the_engine_goes_idle(qwen3_next_dir, tmp_path, monkeypatch):
    # schedule() publishes at most once a second; an idle engine core never calls it again,
    # so the last step's counts must be published when the last request finishes.
    monkeypatch.setattr(counters.tempfile, "gettempdir", lambda: str(tmp_path))
    prefix = list(range(1, 101))
    reqs = [SimRequest("a", prefix + [1], max_tokens=2),
            SimRequest("b", prefix + [2], max_tokens=2, arrival_step=10)]
    replay("lighter", reqs, qwen3_next_dir, block_size=16, max_num_batched_tokens=64)
    assert asdict(read_published(os.getppid())) == snapshot()
