"""GPU end to end (skipped without CUDA): tiny Qwen3-Next (GDN), NemotronH (Mamba2) and
Jamba (Mamba1), eager and with CUDA graphs (vLLM's defaults otherwise: async scheduling),
lighter cache vs prefix caching off vs upstream align; one fresh engine process per mode.

On the device: ``python -m pytest tests/e2e/test_gpu_models.py -k "qwen3_next and graphs"``;
``LIGHTER_MAMBA_GPU_E2E_JSON=PATH`` also writes every run's outputs there.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from .helpers import flat_requests, run_mode, shared_text

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCHS = ("qwen3_next", "nemotron_h", "jamba")
MODES = ("none", "align", "lighter")
KV_BYTES = "LIGHTER_MAMBA_GPU_KV_BYTES"
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
        # float32 states: with bf16 states, where prefill chunks end changes the rounding
        # (prefix caching moves chunk ends to block boundaries), and tiny random models flip.
        "mamba_ssm_cache_dtype": "float32",
    }
    if arch == "qwen3_next":
        args["additional_config"] = {"gdn_prefill_backend": "triton"}
    # Several tests at once on one GPU (scripts/device_e2e.sh): a fixed pool, because vLLM's
    # memory profiling would count the other processes' allocations as this one's.
    if os.environ.get(KV_BYTES):
        args["kv_cache_memory_bytes"] = int(os.environ[KV_BYTES])
    return args


def record(arch: str, eager: bool, results: dict) -> None:
    path = os.environ.get("LIGHTER_MAMBA_GPU_E2E_JSON")
    if not path:
        return
    previous = json.load(open(path)) if os.path.exists(path) else []
    previous.append({"arch": arch, "eager": eager, "results": results})
    with open(path, "w") as f:
        json.dump(previous, f)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_model(arch, eager):
    from tests.conftest import tiny_model

    model = tiny_model(arch)
    results = {mode: run_mode(mode, model, WAVES, engine_args(arch, eager), max_tokens=16) for mode in MODES}
    record(arch, eager, results)
    off, align, lighter = (flat_requests(results[m]) for m in MODES)
    # Hits: the second wave is served from the cache, at least as much as align serves.
    assert lighter[1]["cached_tokens"] > 0
    assert sum(r["cached_tokens"] for r in lighter) >= sum(r["cached_tokens"] for r in align)
    hit_tokens = results["lighter"]["lighter_counters"]["state_hit_tokens"]
    assert hit_tokens == sum(r["cached_tokens"] for r in lighter)
    # Outputs: every request that started from a cached state continues exactly as prefix
    # caching off does; every request's first token agrees. (Under CUDA graphs a request
    # without a hit can flip late: batch composition changes the padded graph and its
    # rounding, with prefix caching off too.)
    for ours, reference in zip(lighter, off, strict=True):
        assert ours["token_ids"][:1] == reference["token_ids"][:1]
        if ours["cached_tokens"] > 0 or eager:
            assert ours["token_ids"] == reference["token_ids"]
