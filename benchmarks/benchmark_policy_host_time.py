"""Host time per scheduler step under memory pressure, one lighter mode against another (by
default the retention policy against vLLM's LRU order): what the policy's bookkeeping costs
the scheduler where it works (lookups, hits, releases, victim picks), in the sweeps of
``benchmark_prefix_caching.py --simulate``.

Each step times ``schedule()`` and ``update_from_output()`` of the replay's scheduler (vLLM's,
model mocked). Modes alternate round by round in one process, so the per-round ratio is paired;
the replay's other work (the mocked model, the workload) is not timed. Modes are separated by
``;`` (a lighter mode's options use commas). The rest of the arguments are
``benchmark_prefix_caching.py``'s (one ``--sim-num-blocks``). A benchmark, not a test.

    python benchmarks/benchmark_policy_host_time.py --rounds 5 \\
        --modes "lighter:inside;lighter:off,inside" -- --simulate --model DIR \\
        --sim-block-size 256 --workload multi-prefix ... --sim-num-blocks 800
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark_prefix_caching  # noqa: E402

from vllm_lighter_mamba.bench import sim  # noqa: E402


def timed_scheduler(make_scheduler, record: list[float]):
    """``make_scheduler`` whose schedulers add each step's host seconds to ``record[0]`` and
    count the steps in ``record[1]``."""

    def timed(method, counts_a_step: bool):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                record[0] += time.perf_counter() - start
                record[1] += counts_a_step

        return wrapper

    def make(*args, **kwargs):
        scheduler = make_scheduler(*args, **kwargs)
        scheduler.schedule = timed(scheduler.schedule, True)
        scheduler.update_from_output = timed(scheduler.update_from_output, False)
        return scheduler

    return make


def measure(modes: list[str], rounds: int, bench_argv: list[str]) -> dict[str, list[float]]:
    """Microseconds of host time per step, per mode, one entry per round."""
    per_step: dict[str, list[float]] = {mode: [] for mode in modes}
    upstream = sim.make_scheduler
    try:
        for round_ in range(rounds):
            for mode in modes:
                record = [0.0, 0]
                sim.make_scheduler = timed_scheduler(upstream, record)
                benchmark_prefix_caching.main([*bench_argv, "--compare", mode, "--output-json", "/dev/null"])
                per_step[mode].append(record[0] / max(record[1], 1) * 1e6)
                print(f"round {round_} {mode}: {record[1]} steps, {per_step[mode][-1]:.0f} us/step",
                      flush=True)
    finally:
        sim.make_scheduler = upstream
    return per_step


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="lighter:inside;lighter:off,inside")
    args = parser.parse_args(argv[:split])
    modes = [m for m in args.modes.split(";") if m]
    per_step = measure(modes, args.rounds, argv[split + 1:])
    first = per_step[modes[0]]
    print("| mode | us/step, median (min-max) | paired ratio to the first mode, median (min-max) |")
    print("|---|---|---|")
    for mode, times in per_step.items():
        ratios = [t / f for t, f in zip(times, first, strict=True)]
        print(f"| {mode} | {statistics.median(times):.0f} ({min(times):.0f}-{max(times):.0f}) | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
    return per_step


if __name__ == "__main__":
    main()
