"""Workload generation for the prefix-caching benchmark."""

from __future__ import annotations

from vllm_lighter_mamba.bench.workloads import WORKLOADS, WorkloadSpec, wave_source


def first_prompt(name: str, spec: WorkloadSpec) -> list[int]:
    return wave_source(name, spec)({})[0].prompt_token_ids


def test_workloads_do_not_share_prefixes():
    # Workloads run one after another in one engine: a shared first block would let a later
    # workload's first request hit the earlier workload's cache and start warm.
    spec = WorkloadSpec(prefix_len=256, input_length_range=(16, 32))
    heads = {name: tuple(first_prompt(name, spec)[:16]) for name in WORKLOADS}
    assert len(set(heads.values())) == len(WORKLOADS)


def test_workloads_are_reproducible_per_seed():
    spec = WorkloadSpec(prefix_len=64, input_length_range=(8, 16))
    assert first_prompt("divergent", spec) == first_prompt("divergent", spec)
    assert first_prompt("divergent", spec) != first_prompt("divergent", WorkloadSpec(prefix_len=64, seed=1))


def test_multi_prefix_zipf_popularity_and_open_arrivals():
    spec = WorkloadSpec(num_prompts=600, num_prefixes=12, prefix_len=64, input_length_range=(8, 16),
                        arrival_rate=2.0, zipf_s=1.0)
    source = wave_source("multi-prefix", spec)
    requests = source.initial
    assert len(requests) == 600
    arrivals = [r.arrival for r in requests]
    assert arrivals == sorted(arrivals) and 200 < arrivals[-1] < 400  # about 600 / 2 steps
    heads: dict[tuple, int] = {}
    for r in requests:
        heads[tuple(r.prompt_token_ids[:16])] = heads.get(tuple(r.prompt_token_ids[:16]), 0) + 1
    counts = sorted(heads.values(), reverse=True)
    assert len(counts) <= 12 and counts[0] > 4 * counts[-1]  # Zipf: the top prompt dominates
    # Engine mode: one wave, then nothing (no request has a follow-up).
    assert source({}) == requests
    assert source({r.request_id: [1] for r in requests}) is None


def test_multi_turn_sessions_extend_the_previous_turn():
    spec = WorkloadSpec(num_prompts=5, num_turns=3, num_prefixes=2, prefix_len=64,
                        input_length_range=(8, 16), think_steps=(3, 3))
    source = wave_source("multi-turn-sessions", spec)
    first = source.initial[0]
    assert first.request_id == "s0-t0"
    reply = [7, 8, 9]
    second = source.follow_up("s0-t0", reply)
    assert second.request_id == "s0-t1" and second.arrival == 3
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + 3] == first.prompt_token_ids + reply
    third = source.follow_up("s0-t1", [1])
    assert third.prompt_token_ids[: len(second.prompt_token_ids)] == second.prompt_token_ids
    assert source.follow_up("s0-t2", [1]) is None  # three turns
