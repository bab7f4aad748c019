"""Hit tokens of the lighter cache against vLLM's align mode over random scheduler traces.

Each trace (``bench.workloads.random_trace``: shared prefixes, arrivals, up to 8 running
requests, small pools, sync and async with overlap, block sizes 16 to 1056) is replayed
through vLLM's real scheduler and KV-cache manager with a mocked model, once per mode. Counts
the traces where the lighter cache caches fewer / more prompt tokens than align, by pool size,
and the total hit tokens. A benchmark, not a test (the strict property, one request running at
a time, is ``tests/v1/core/test_random_traces.py``).

    python benchmarks/benchmark_random_traces.py [--num-traces 3000] [--seed 0] [--json OUT] \\
        [--mode lighter:off]     # without the state retention policy (vLLM's LRU order)
"""

from __future__ import annotations

import argparse
import collections
import json
import random


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-traces", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0, help="trace i uses seed + i")
    parser.add_argument("--model", default=".tiny_models/qwen3_next", help="hybrid model dir (config only)")
    parser.add_argument("--mode", default="lighter",
                        help="the lighter mode compared with align: lighter, lighter:off (no retention "
                        "policy), lighter:alpha=X,share=Y")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    from vllm_lighter_mamba.bench.sim import SimRequest, replay
    from vllm_lighter_mamba.bench.workloads import random_trace

    counts: dict = collections.defaultdict(collections.Counter)
    for i in range(args.num_traces):
        requests, kwargs, run = random_trace(random.Random(args.seed + i))
        requests = [SimRequest(r.request_id, r.prompt_token_ids, r.max_tokens, r.arrival_step)
                    for r in requests]  # no aborts: both modes see the same requests through
        run = {**run, "resets": []}
        align = replay("align", requests, args.model, max_steps=50_000, **run, **kwargs)
        ours = replay(args.mode, requests, args.model, max_steps=50_000, **run, **kwargs)
        pool = "400 blocks" if kwargs["num_blocks"] == 400 else "small pool"
        row = counts[pool]
        row["traces"] += 1
        row["below"] += ours.cached_tokens < align.cached_tokens
        row["above"] += ours.cached_tokens > align.cached_tokens
        row["align_hit_tokens"] += align.cached_tokens
        row["lighter_hit_tokens"] += ours.cached_tokens
        row["lost_vs_align_tokens"] += max(align.cached_tokens - ours.cached_tokens, 0)
        row["outputs_differ"] += ours.outputs != align.outputs
    print("| pool | traces | lighter < align | lighter > align | hit tokens lighter/align | "
          "tokens lost where below | outputs differ |")
    print("|---|---|---|---|---|---|---|")
    for pool, row in sorted(counts.items()):
        ratio = row["lighter_hit_tokens"] / max(row["align_hit_tokens"], 1)
        print(f"| {pool} | {row['traces']} | {row['below']} | {row['above']} | {ratio:.3f} | "
              f"{row['lost_vs_align_tokens']} | {row['outputs_differ']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({pool: dict(row) for pool, row in counts.items()}, f, indent=1)


if __name__ == "__main__":
    main()
