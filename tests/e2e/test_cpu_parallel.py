"""Tensor and pipeline parallelism on vLLM's CPU backend (issue 15): real worker processes,
one OpenMP thread group (one core) per rank. The lighter cache runs its gather and state copy
on every rank over that rank's shard (TP) or layers (PP), with the block ids the one
scheduler decided.

The reference is prefix caching off under the same layout, one request at a time with chunks
of one block (as in test_cpu_lighter_cache): the lighter cache's greedy tokens and
log-probabilities must equal it exactly.
"""

from __future__ import annotations

from math import prod

import pytest

from .helpers import CPU_ENGINE, RPC_ENV, exact_differences, flat_requests, run_mode, shared_text
from .test_cpu_lighter_cache import BLOCK_SIZE

pytestmark = pytest.mark.engine

PREFIX = shared_text(12, 1100)
WAVES = [
    [PREFIX + " question zero?"],
    [PREFIX + " question one?", PREFIX + " a second, longer question?", "hi there"],
]
RANKS_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# (RPC_ENV: the per-rank record; the runner also calls collective_rpc on a pipeline layout's
# workers before the first step: runner.allocate_stage_inputs, vLLM 0.32's CPU backend in
# eager mode never allocates a later stage's input buffer.)
LAYOUTS = {
    "tp2": ("qwen3_next", {"tensor_parallel_size": 2}),
    "pp2": ("qwen3_next_pp", {"pipeline_parallel_size": 2}),
}


def engine(parallel: dict) -> dict:
    return {**CPU_ENGINE, "max_num_seqs": 1, "max_num_batched_tokens": BLOCK_SIZE, "disable_log_stats": False,
            "distributed_executor_backend": "mp", **parallel}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request):
    from tests.conftest import tiny_model

    arch, parallel = LAYOUTS[request.param]
    model = tiny_model(arch)
    off = run_mode("none", model, WAVES, engine(parallel), env={**RANKS_ENV, **RPC_ENV}, top2=True)
    lighter = run_mode("lighter", model, WAVES, engine(parallel), env={**RANKS_ENV, **RPC_ENV}, metrics=True,
                       ranks=True, top2=True)
    lighter_one_rank = run_mode("lighter", model, WAVES, engine({}), env=RPC_ENV, ranks=True)
    align = run_mode("align", model, WAVES, engine(parallel), env={**RANKS_ENV, **RPC_ENV})
    return request.param, {"off": off, "lighter": lighter, "lighter_one_rank": lighter_one_rank,
                           "align": align}


def test_greedy_outputs_equal_prefix_caching_off_under_the_same_layout(runs):
    _, results = runs
    assert results["lighter"]["block_size"] == BLOCK_SIZE
    assert exact_differences(flat_requests(results["lighter"]), flat_requests(results["off"])) == []


def test_second_wave_hits_at_least_align_under_the_same_layout(runs):
    _, results = runs
    ours, align = flat_requests(results["lighter"])[1:], flat_requests(results["align"])[1:]
    assert ours[0]["cached_tokens"] > 0
    assert all(o["cached_tokens"] >= a["cached_tokens"] for o, a in zip(ours, align, strict=True))
    counters = results["lighter"]["lighter_counters"]
    assert counters["state_hit_tokens"] == sum(r["cached_tokens"] for r in flat_requests(results["lighter"]))


def test_pool_is_back_to_its_initial_state(runs):
    _, results = runs
    assert results["lighter"]["kv_cache_usage"] == 0.0


def test_every_rank_copies_the_same_blocks_of_its_own_states(runs):
    layout, results = runs
    ranks = results["lighter"]["ranks"]
    single = results["lighter_one_rank"]["ranks"][0]
    assert len(ranks) == 2 and all(rank["copier"] and rank["num_moves"] > 0 for rank in ranks)
    # One scheduler: both ranks moved the same states between the same block ids, step by
    # step. (A separate one-rank engine may batch the requests differently: the engine core
    # starts on the first request while the others are still being added.)
    assert ranks[0]["num_moves"] == ranks[1]["num_moves"] <= 256  # all of them recorded
    assert ranks[0]["recent_moves"] == ranks[1]["recent_moves"]
    if layout == "tp2":
        # Each rank holds half of every state (its share of the heads).
        for rank in ranks:
            for shard, full in zip(rank["shapes"][0], single["shapes"][0], strict=True):
                assert 2 * prod(shard) == prod(full)
    else:
        # Each stage holds the states of its own layers: together, all of them.
        layers = sum(len(g) for rank in ranks for g in rank["shapes"])
        assert layers == sum(len(g) for g in single["shapes"])
        assert all(sum(len(g) for g in rank["shapes"]) < layers for rank in ranks)
