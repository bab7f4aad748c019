"""How often the lighter cache gets fewer hit tokens than align under memory pressure, on the
retention property test's small random traces (``bench.workloads.history_trace``: system
prompts, exact repeats, multi-turn continuations, blocks of 4-16 tokens, pools from the
smallest that runs every request up), replayed through vLLM's real scheduler and KV-cache
manager with a mocked model. A benchmark, not a test: no eviction order beats LRU on every
trace, so the test keeps only the summed property.

Two views of a case below align: whether the lighter cache then computes more prompt tokens than
align (hit tokens are a proxy; a preemption re-prefills and can hit its own states again, which
counts as hit tokens without saving anything new), and whether it is below align where neither
mode preempted (a shortfall the eviction order alone explains).

    python benchmarks/benchmark_pressure_traces.py [--num-traces 200] [--modes lighter,lighter:off]
        [--list-below]

Mode ``oracle``: the lighter cache with ``benchmark_oracle_eviction.py``'s eviction order (the
future known). With it and one other mode, the cases below align in both are counted by why
(``benchmark_oracle_eviction.shortfall_kind``, on the other mode's replay).

``--list-below`` also prints each case below align (seed, pool, hit tokens, preemptions,
computed tokens); ``explain_pressure_case.py --seed S --pool N`` shows one step by step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-traces", type=int, default=200, help="trace i uses seed i")
    parser.add_argument("--first-trace", type=int, default=0, help="the seed of the first trace")
    parser.add_argument("--modes", default="lighter,lighter:off",
                        help="lighter modes compared with align (lighter:off: no retention policy)")
    parser.add_argument("--model", default=".tiny_models/qwen3_next", help="hybrid model dir (config only)")
    parser.add_argument("--list-below", action="store_true", help="print each case below align")
    args = parser.parse_args(argv)
    from vllm_lighter_mamba.bench.sim import MODES, replay, split_modes
    from vllm_lighter_mamba.bench.workloads import history_trace

    modes = split_modes(args.modes, (*MODES, "oracle"))
    if "oracle" in modes:
        import benchmark_oracle_eviction as oracle
    both_below: dict[str, int] | None = {} if "oracle" in modes and len(modes) == 2 else None
    rows = {mode: {"cases": 0, "evicting": 0, "below": 0, "hit_tokens": 0, "worst": 0.0, "worst_case": None,
                   "below_5pct": 0, "below_by_pool": [0] * 6, "computes_more": 0, "no_preemption": 0,
                   "below_no_preemption": 0, "computed": 0} for mode in modes}
    align_hit_tokens = align_computed = 0
    for seed in range(args.first_trace, args.first_trace + args.num_traces):
        requests, kwargs, pools = history_trace(seed)
        for rank, num_blocks in enumerate(pools[:6]):  # the pool sizes the property test sums over
            align = replay("align", requests, args.model, num_blocks=num_blocks, max_steps=20_000, **kwargs)
            align_hit_tokens += align.cached_tokens
            align_tokens = align.computed_tokens
            align_computed += align_tokens
            below = {}  # mode -> its replay, where it is below align in a case that evicts
            for mode in modes:
                if mode == "oracle":
                    ours = oracle.replay_with_oracle(requests, args.model, num_blocks, **kwargs)
                else:
                    ours = replay(mode, requests, args.model, num_blocks=num_blocks, max_steps=20_000,
                                  **kwargs)
                row = rows[mode]
                row["cases"] += 1
                row["hit_tokens"] += ours.cached_tokens
                ours_tokens = ours.computed_tokens
                row["computed"] += ours_tokens
                evicted = align.evicted_state_blocks + align.evicted_attn_blocks
                evicted += ours.evicted_state_blocks + ours.evicted_attn_blocks
                if evicted:
                    is_below = ours.cached_tokens < align.cached_tokens
                    row["evicting"] += 1
                    row["below"] += is_below
                    if is_below:
                        below[mode] = ours
                    row["below_by_pool"][rank] += is_below
                    # The shortfall as a share of align's hit tokens in that case.
                    short = (align.cached_tokens - ours.cached_tokens) / max(align.cached_tokens, 1)
                    row["below_5pct"] += short > 0.05
                    row["computes_more"] += ours_tokens > align_tokens
                    if not align.preemptions and not ours.preemptions:
                        row["no_preemption"] += 1
                        row["below_no_preemption"] += is_below
                    if args.list_below and is_below:
                        print(f"below align: {mode} seed {seed} pool {num_blocks}: hit tokens "
                              f"{ours.cached_tokens} against {align.cached_tokens}, preemptions "
                              f"{ours.preemptions} against {align.preemptions}, computed tokens "
                              f"{ours_tokens} against {align_tokens}", flush=True)
                    if short > row["worst"]:
                        row["worst"], row["worst_case"] = short, (seed, num_blocks)
            if both_below is not None and len(below) == 2:
                other = next(result for mode, result in below.items() if mode != "oracle")
                kind = oracle.shortfall_kind(align, other)
                both_below[kind] = both_below.get(kind, 0) + 1
    print("| mode | cases | with evictions | below align | share of those | below by > 5% | "
          "worst shortfall (seed, pool) | hit tokens / align |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, row in rows.items():
        share = row["below"] / max(row["evicting"], 1)
        print(f"| {mode} | {row['cases']} | {row['evicting']} | {row['below']} | {share:.3f} | "
              f"{row['below_5pct']} | {row['worst']:.3f} {row['worst_case']} | "
              f"{row['hit_tokens'] / max(align_hit_tokens, 1):.3f} |")
    print()
    print("| mode | computes more tokens than align | computed tokens / align | cases where neither "
          "preempted | below align there |")
    print("|---|---|---|---|---|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['computes_more']} | {row['computed'] / max(align_computed, 1):.3f} | "
              f"{row['no_preemption']} | {row['below_no_preemption']} |")
    print("below align by pool size (smallest that runs every request, +2, +5 blocks, x1.5, x2, x4): "
          + "; ".join(f"{mode} {row['below_by_pool']}" for mode, row in rows.items()))
    if both_below is not None:
        evicting = rows["oracle"]["evicting"]
        total = sum(both_below.values())
        other = next(mode for mode in modes if mode != "oracle")
        print(f"below align with both {other} and the oracle: {total} ({total / max(evicting, 1):.3f}); "
              f"{other}'s replay there:")
        for kind, count in sorted(both_below.items()):
            print(f"- {kind}: {count} ({count / max(evicting, 1):.3f})")


if __name__ == "__main__":
    main()
