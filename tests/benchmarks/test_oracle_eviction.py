"""benchmarks/benchmark_oracle_eviction.py: Belady's farthest-next-use order on the pool's free
cached pages, the bound the retention policy is measured against."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.request import RequestStatus

from vllm_lighter_mamba.bench.sim import SimRequest, make_request, replay
from vllm_lighter_mamba.bench.workloads import history_trace

from . import load_benchmark

BLOCK = 4
FIRST = SimRequest("first", list(range(1, 10)), 2, 0)  # blocks [1-4], [5-8] can be hit
LATER = SimRequest("later", [1, 2, 3, 4, 50, 51, 52], 2, 10)  # shares the first block only


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("benchmark_oracle_eviction")


def running(sim_request: SimRequest):
    request = make_request(sim_request, BLOCK)
    request.status = RequestStatus.RUNNING
    return request


def test_next_use_is_the_next_arrival_of_a_request_that_can_hit_it(bench):
    future = bench.Future([FIRST, LATER], BLOCK)
    shared, own = (bytes(h) for h in make_request(FIRST, BLOCK).block_hashes[:2])
    future.now = 3
    future.live = {"first": running(FIRST)}
    assert future.next_use(shared) == 10  # "later" arrives at 10 and can hit it
    assert future.next_use(own) == math.inf  # only "first" could, and it has started
    future.now = 12
    future.live["later"] = running(LATER)
    assert future.next_use(shared) == math.inf  # started: it will not look it up again
    future.live["later"].status = RequestStatus.PREEMPTED
    assert future.next_use(shared) == 12  # preempted: it looks it up again now


def test_the_page_used_farthest_ahead_is_evicted_first(bench):
    future = bench.Future([FIRST, LATER], BLOCK)
    future.live = {"first": running(FIRST)}
    shared, own = make_request(FIRST, BLOCK).block_hashes[:2]
    blocks = [KVCacheBlock(block_id=i) for i in range(3)]
    blocks[0].set_block_hash(make_block_hash_with_group_id(shared, 0))  # LRU's first victim
    blocks[1].set_block_hash(make_block_hash_with_group_id(own, 0))
    pool = SimpleNamespace(free_block_queue=FreeKVCacheBlockQueue(blocks))
    retention = SimpleNamespace(pool=pool, pending={})
    victims = bench.oracle_pick(future)(retention, 1)
    assert [b.block_id for b in victims] == [1]  # never used again, although LRU would take 0
    assert retention.pending == {1: "ranked_state"}
    # Both pages: the unused one first, then the shared one; the hashless block is no victim.
    assert [b.block_id for b in bench.oracle_pick(future)(retention, 3)] == [1, 0]


def test_the_oracle_replays_a_pressure_case_through_vllms_scheduler(bench, qwen3_next_dir, monkeypatch):
    from vllm_lighter_mamba.v1.core.block_pool_retention import StateRetention

    requests, kwargs, pools = history_trace(107)
    original = StateRetention._pick
    calls = []
    pick = bench.oracle_pick

    def counting(future):
        inner = pick(future)

        def counted(retention, count):
            victims = inner(retention, count)
            calls.append(len(victims))
            return victims

        return counted

    monkeypatch.setattr(bench, "oracle_pick", counting)
    ours = bench.replay_with_oracle(requests, qwen3_next_dir, pools[4], **kwargs)
    align = replay("align", requests, qwen3_next_dir, num_blocks=pools[4], max_steps=20_000, **kwargs)
    assert sum(calls) > 0  # the oracle picked this case's victims
    assert ours.outputs == align.outputs  # every request finished
    assert StateRetention._pick is original  # the patch ends with the replay


def result(cached: dict[str, int], computed: int, preempted: tuple[str, ...] = ()):
    requests = {rid: SimpleNamespace(num_preemptions=int(rid in preempted)) for rid in cached}
    return SimpleNamespace(cached_tokens=sum(cached.values()), cached_per_request=cached,
                           computed_tokens=computed, requests=requests)


def test_a_shortfall_is_told_apart_from_align_hits_lost_to_preemption(bench):
    ours = result({"a": 0, "b": 8}, computed=100)
    # Align's extra 16 tokens went to "a", which it preempted afterwards.
    kind = bench.shortfall_kind(result({"a": 16, "b": 8}, computed=100, preempted=("a",)), ours)
    assert kind == "align's extra hits went to requests it preempted later"
    # Not preempted: a shortfall, real where ours computes more tokens.
    align = result({"a": 16, "b": 8}, computed=100)
    assert bench.shortfall_kind(align, ours) == "computes no more tokens than align"
    align = result({"a": 16, "b": 8}, computed=90)
    assert bench.shortfall_kind(align, ours) == "computes more tokens than align"


SWEEP = ["--simulate", "--sim-block-size", "16", "--max-num-batched-tokens", "256", "--max-num-seqs", "8",
         "--compare", "align,lighter:inside", "--num-prompts", "40", "--num-prefixes", "4",
         "--prefix-len", "96", "--input-length-range", "8:32", "--output-len", "8", "--arrival-rate", "1",
         "--sim-num-blocks", "24"]


def test_a_sweep_replays_the_lighter_mode_with_the_oracle(bench, qwen3_next_dir, monkeypatch, tmp_path):
    from vllm_lighter_mamba.bench import sim

    calls = []
    pick = bench.oracle_pick
    monkeypatch.setattr(bench, "oracle_pick",
                        lambda future: lambda retention, n: calls.append(n) or pick(future)(retention, n))
    out = tmp_path / "sweep.json"
    upstream = sim.replay
    bench.main(["--", *SWEEP, "--model", qwen3_next_dir, "--workload", "multi-prefix",
                "--output-json", str(out)])
    assert sum(calls) > 0  # the lighter replay's victims were the oracle's
    modes = [r["mode"] for r in json.loads(out.read_text())["results"]]
    assert modes == ["align", "lighter:inside"]
    assert sim.replay is upstream  # put back


def test_a_sweep_refuses_a_workload_with_follow_ups(bench, qwen3_next_dir, tmp_path):
    with pytest.raises(SystemExit, match="follow-ups"):
        bench.main(["--", *SWEEP, "--model", qwen3_next_dir, "--workload", "multi-turn-sessions",
                    "--output-json", str(tmp_path / "sweep.json")])


def test_the_suite_counts_the_cases_below_align_with_both_orders(bench, qwen3_next_dir, capsys):
    # Seed 14 at its smallest pool (16 blocks): below align with the policy and the oracle
    # alike, because align's extra hit went to a request it preempted afterwards.
    bench.main(["--first-trace", "14", "--num-traces", "1", "--model", qwen3_next_dir])
    out = capsys.readouterr().out
    assert "below align with both lighter:inside and the oracle: 1 " in out
    assert "- align's extra hits went to requests it preempted later: 1 " in out
