"""benchmarks/benchmark_policy_host_time.py: host time per scheduler step of two lighter modes
on a simulated sweep point, alternated."""

from __future__ import annotations

from vllm_lighter_mamba.bench import sim

from . import load_benchmark


def test_each_mode_gets_a_time_per_step_and_the_simulator_is_restored(qwen3_next_dir):
    bench = load_benchmark("benchmark_policy_host_time")
    upstream = sim.make_scheduler
    per_step = bench.main([
        "--rounds", "1", "--modes", "lighter:inside;lighter:off,inside", "--",
        "--simulate", "--model", qwen3_next_dir, "--sim-block-size", "16", "--max-num-batched-tokens", "256",
        "--max-num-seqs", "8", "--workload", "multi-prefix", "--num-prompts", "24", "--num-prefixes", "4",
        "--prefix-len", "64", "--input-length-range", "8:32", "--output-len", "8", "--arrival-rate", "1",
        "--sim-num-blocks", "40",
    ])
    assert set(per_step) == {"lighter:inside", "lighter:off,inside"}
    assert all(len(times) == 1 and times[0] > 0 for times in per_step.values())
    assert sim.make_scheduler is upstream
