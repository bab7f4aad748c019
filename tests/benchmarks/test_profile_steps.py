"""The step timeline read from a real torch-profiler trace (CPU activities)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from . import load_benchmark

profile_steps = load_benchmark("profile_steps")


def _trace(tmp_path: Path) -> Path:
    """Three prefill steps with 2 matmuls each, two decode steps with one, a sort between steps."""
    x = torch.ones(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(5):
            prefill = i < 3
            name = f"execute_context_{1 if prefill else 0}({100 if prefill else 0})_generation_2(2)"
            with torch.profiler.record_function(name):
                for _ in range(2 if prefill else 1):
                    torch.mm(x, x)
            torch.sort(x)  # between steps: the scheduler's place
    path = tmp_path / "worker.pt.trace.json"
    prof.export_chrome_trace(str(path))
    return path


def test_steps_are_split_by_kind_and_host_ops_attributed_to_steps(tmp_path):
    trace = _trace(tmp_path)
    summary = profile_steps.step_timeline(profile_steps.load_events(profile_steps.find_trace(tmp_path)))
    assert summary["steps"] == 5
    assert summary["kinds"]["prefill"]["host_ms"]["count"] == 3
    assert summary["kinds"]["decode"]["host_ms"]["count"] == 2
    assert summary["kinds"]["prefill"]["tokens"]["median"] == 102  # 100 prompt + 2 decode tokens
    assert summary["kinds"]["decode"]["period_ms"]["count"] == 1  # the last step has no successor
    in_steps = {r["name"]: r for r in summary["host_ops_in_steps"]}
    assert in_steps["cpu_op:aten::mm"]["count"] == 3 * 2 + 2
    assert in_steps["cpu_op:aten::mm"]["per_step"] == pytest.approx(8 / 5)
    assert "cpu_op:aten::sort" not in in_steps
    between = {r["name"] for r in summary["host_ops_between_steps"]}
    assert "cpu_op:aten::sort" in between
    assert profile_steps.find_trace(trace) == trace
    steps = summary["prefill_steps"]
    assert [s["prefill_tokens"] for s in steps] == [100, 100, 100]
    assert [s["decode_requests"] for s in steps] == [2, 2, 2]
    assert steps[0]["start_ms"] == 0 and steps[0]["start_ms"] < steps[1]["start_ms"] < steps[2]["start_ms"]
    assert all(s["period_ms"] >= s["host_ms"] > 0 for s in steps)


def test_a_trace_without_step_annotations_is_one_clear_error(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
    path = tmp_path / "front.pt.trace.json"
    prof.export_chrome_trace(str(path))
    with pytest.raises(ValueError, match="not a worker trace"):
        profile_steps.step_timeline(profile_steps.load_events(path))
