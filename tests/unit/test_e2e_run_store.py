"""The end-to-end helpers' run store (LIGHTER_MAMBA_E2E_RUNS_DIR): a GPU test longer than one
device call resumes from the engine runs it finished, and never from a run of other inputs."""

from __future__ import annotations

import json
import subprocess

from tests.e2e import helpers


def fake_engine(calls: list):
    """subprocess.run standing in for the runner: records the call, writes a result."""

    def run(argv, **kwargs):
        calls.append(argv)
        spec_path, out_path = argv[-2:]
        with open(spec_path) as f:
            mode = json.load(f)["mode"]
        with open(out_path, "w") as f:
            json.dump({"mode": mode, "run": len(calls)}, f)
        return subprocess.CompletedProcess(argv, 0, "", "")

    return run


def test_a_kept_run_is_reused_only_for_the_same_inputs(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(helpers.subprocess, "run", fake_engine(calls))
    monkeypatch.setenv(helpers.RUNS_DIR, str(tmp_path / "runs"))
    drafts = tmp_path / "drafts.json"
    drafts.write_text("[1]")
    args = ("lighter", "/model", [["a prompt"]], {"enforce_eager": False})

    first = helpers.run_mode(*args, env={"DRAFTS": str(drafts)})
    assert helpers.run_mode(*args, env={"DRAFTS": str(drafts)}) == first and len(calls) == 1
    # The same file content under another name is the same run; other content is not.
    moved = tmp_path / "elsewhere.json"
    moved.write_text("[1]")
    assert helpers.run_mode(*args, env={"DRAFTS": str(moved)}) == first and len(calls) == 1
    drafts.write_text("[2]")
    assert helpers.run_mode(*args, env={"DRAFTS": str(drafts)})["run"] == 2
    # Another mode, another engine setting: new runs.
    assert helpers.run_mode("align", *args[1:], env={"DRAFTS": str(drafts)})["run"] == 3
    assert helpers.run_mode(*args[:3], {"enforce_eager": True}, env={"DRAFTS": str(drafts)})["run"] == 4


def test_without_the_store_every_run_starts_an_engine(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(helpers.subprocess, "run", fake_engine(calls))
    monkeypatch.delenv(helpers.RUNS_DIR, raising=False)
    for _ in range(2):
        helpers.run_mode("none", "/model", [["a prompt"]], {})
    assert len(calls) == 2
