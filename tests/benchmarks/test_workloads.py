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
