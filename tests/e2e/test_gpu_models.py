"""GPU end to end (skipped without CUDA): tiny Qwen3-Next (GDN), NemotronH (Mamba2) and
Jamba (Mamba1), eager and with CUDA graphs, lighter cache vs prefix caching off (and
upstream align, eager), greedy outputs and second-wave hits.

Also a script, for the device machine: ``python -m tests.e2e.test_gpu_models OUT.json``
runs every combination in one process (the variable is switched per engine, which the
patches read at call time, and engine-core processes inherit it when they start);
``GPU_E2E_ISOLATE=1`` runs each combination in its own process instead.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import pytest
import torch

from .helpers import shared_text

ARCHS = ("qwen3_next", "nemotron_h", "jamba")
PREFIX = shared_text(5, 1500)
WAVES = [
    [PREFIX + " first?"],
    [PREFIX + " second?", PREFIX + " third, longer?", "short one", shared_text(6, 600) + " b"],
    [shared_text(7, 900) + " x", shared_text(7, 900) + " y"],
    [shared_text(6, 600) + " b2", shared_text(7, 900) + " z"],
]


def engine_args(arch: str, eager: bool) -> dict:
    args = {
        "max_model_len": 4096,
        "max_num_batched_tokens": 1024,
        "max_num_seqs": 16,
        "gpu_memory_utilization": 0.12,
        "enforce_eager": eager,
    }
    if arch == "qwen3_next":
        args["additional_config"] = {"gdn_prefill_backend": "triton"}
    # float32 states: with bf16 states, where prefill chunks end changes the rounding
    # (prefix caching moves chunk ends to block boundaries), and tiny random models flip.
    args["mamba_ssm_cache_dtype"] = "float32"
    return {k: v for k, v in args.items() if v is not None}


def run_combo(arch: str, model: str, eager: bool, mode: str) -> dict:
    from vllm_lighter_mamba.testing.e2e_runner import run

    os.environ["VLLM_USE_LIGHTER_MAMBA_CACHE"] = "1" if mode == "lighter" else "0"
    start = time.perf_counter()
    try:
        result = run({"mode": mode, "model": model, "engine": engine_args(arch, eager), "waves": WAVES,
                      "max_tokens": 16})
        result["error"] = None
    except Exception as exc:  # recorded, so one failing model does not hide the others
        result = {"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    finally:
        os.environ["VLLM_USE_LIGHTER_MAMBA_CACHE"] = "0"
        gc.collect()

    result.update(arch=arch, eager=eager, seconds_total=time.perf_counter() - start)
    return result


def tokens(result: dict) -> list[list[int]]:
    return [r["token_ids"] for w in result["waves"] for r in w["requests"]]


def cached(result: dict) -> list[int]:
    return [r["cached_tokens"] for w in result["waves"] for r in w["requests"]]


def default_plan(archs=ARCHS) -> list[tuple[str, bool, str]]:
    """Eager first for every model (cheapest), then CUDA graphs, then the align baseline."""
    plan = [(arch, True, mode) for arch in archs for mode in ("lighter", "none")]
    plan += [(arch, False, mode) for arch in archs for mode in ("lighter", "none")]
    return plan + [(arch, True, "align") for arch in archs]


def run_all(model_root: str, archs=ARCHS, plan=None, out_path: str | None = None) -> list[dict]:
    """Run the plan; with ``out_path`` the results so far are rewritten after every engine."""
    from vllm_lighter_mamba.patch import apply_all_patches
    from vllm_lighter_mamba.testing.tiny_models import build_tiny_model

    apply_all_patches()
    results = []
    models: dict[str, str] = {}
    for arch, eager, mode in plan or default_plan(archs):
        if arch not in models:
            models[arch] = str(build_tiny_model(arch, os.path.join(model_root, arch)))
        results.append(run_combo(arch, models[arch], eager, mode))
        r = results[-1]
        brief = {k: r.get(k) for k in ("arch", "eager", "mode", "error", "block_size", "seconds_total")}
        if not r["error"]:
            brief["cached"] = cached(r)
            brief["tokens_hash"] = hash(str(tokens(r)))
        print(json.dumps(brief), flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(results, f)
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_model(arch, tmp_path):
    results = run_all(str(tmp_path), archs=(arch,))
    for eager in (True, False):
        by_mode = {r["mode"]: r for r in results if r["eager"] == eager}
        assert all(r["error"] is None for r in by_mode.values()), by_mode
        assert tokens(by_mode["lighter"]) == tokens(by_mode["none"])
        assert cached(by_mode["lighter"])[1] > 0


def run_isolated(plan, out_path: str) -> list[dict]:
    """Each combination in a fresh Python process (engine in-process there): a second
    engine in one process can trip vLLM's "Error in memory profiling" check while the
    first one's memory is still being released."""
    import subprocess
    import tempfile

    results = []
    for arch, eager, mode in plan:
        step = f"{arch}:{'eager' if eager else 'graphs'}:{mode}"
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            env = dict(os.environ, GPU_E2E_PLAN=step, GPU_E2E_ISOLATE="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
            proc = subprocess.run([sys.executable, "-m", "tests.e2e.test_gpu_models", tmp.name], env=env)
            try:
                with open(tmp.name) as f:
                    results += json.load(f)
            except (OSError, ValueError):
                results.append({"arch": arch, "eager": eager, "mode": mode,
                                "error": f"process exited {proc.returncode} without results"})
        with open(out_path, "w") as f:
            json.dump(results, f)
    return results


if __name__ == "__main__":
    out = sys.argv[1]
    plan = None
    if os.environ.get("GPU_E2E_PLAN"):  # e.g. "jamba:eager:lighter,jamba:graphs:none"
        steps = (x.split(":") for x in os.environ["GPU_E2E_PLAN"].split(","))
        plan = [(arch, kind == "eager", mode) for arch, kind, mode in steps]
    if os.environ.get("GPU_E2E_ISOLATE", "0") == "1":
        all_results = run_isolated(plan or default_plan(), out)
    else:
        all_results = run_all(os.environ.get("TINY_MODEL_ROOT", "/tmp/tiny_models"), plan=plan, out_path=out)
    for eager in (True, False):
        for arch in ARCHS:
            rows = {r["mode"]: r for r in all_results if r["arch"] == arch and r["eager"] == eager}
            if "lighter" not in rows or "none" not in rows:
                continue
            if any(r["error"] for r in rows.values()):
                print(arch, "eager" if eager else "graphs", {m: r["error"] for m, r in rows.items()})
                continue
            same = tokens(rows["lighter"]) == tokens(rows["none"])
            same_align = tokens(rows["lighter"]) == tokens(rows["align"]) if "align" in rows else None
            print(arch, "eager" if eager else "graphs", "outputs==off:", same, "outputs==align:", same_align,
                  {m: cached(r) for m, r in rows.items()})
