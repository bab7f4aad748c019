"""One case of the retention property suite, step by step: how the losing cases that
``benchmark_pressure_traces.py --list-below`` names are read.

For each mode (align and a lighter mode by default) it prints every step's chunks
(``request:start+tokens``), preemptions, and the cached pages that step's allocations evicted:
whose block they were (the first request that hashed that prefix, and the position after the
block), the Mamba or attention group, and, for the lighter cache, why the retention policy
picked it and the state's flags just before (see ``PrefixNode``: R resumable, P provisional,
S shared, E prompt end, C continuation, B checkpoint bet, X branched). Then each request's hit.
The trace's requests come first, with the tokens each shares with every earlier prompt (and
with that prompt followed by its reply: where a next turn resumes).

    python benchmarks/explain_pressure_case.py --seed 107 --pool 30 [--modes align,lighter:inside,oracle]

``oracle``: the lighter cache with ``benchmark_oracle_eviction.py``'s eviction order (the future
known), to see which pages it keeps where the policy loses.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

FLAGS = (("R", "resumable"), ("P", "provisional"), ("S", "shared"), ("E", "prompt_end"),
         ("C", "continuation"), ("B", "bet"), ("X", "branched"))


def describe_trace(requests: list) -> list[str]:
    """One line per request: its length, max tokens, arrival and what it shares with earlier ones."""
    from vllm_lighter_mamba.bench.sim import continuation

    lines = []
    for i, request in enumerate(requests):
        shared = []
        for earlier in requests[:i]:
            prompt = len(os.path.commonprefix([earlier.prompt_token_ids, request.prompt_token_ids]))
            turn = earlier.prompt_token_ids + continuation(earlier.prompt_token_ids, earlier.max_tokens)
            with_reply = len(os.path.commonprefix([turn, request.prompt_token_ids]))
            if prompt or with_reply:
                shared.append(f"{earlier.request_id}:{prompt}/{with_reply}")
        lines.append(f"{request.request_id}: {len(request.prompt_token_ids)} tokens, "
                     f"max {request.max_tokens}, arrives at step {request.arrival_step}; "
                     f"shares {' '.join(shared) or 'nothing'}")
    return lines


def node_flags(node) -> str:
    return "".join(letter for letter, name in FLAGS if getattr(node, name)) or "-"


def explain(mode: str, requests: list, model: str, num_blocks: int, kwargs: dict) -> list[str]:
    """The step-by-step lines of one replay of ``mode``."""
    from vllm_lighter_mamba.bench.sim import cached_block_tracker, make_scheduler, replay
    from vllm_lighter_mamba.v1.core.block_pool_retention import retention_of

    block_size = kwargs["block_size"]
    engine_mode = "lighter:inside" if mode == "oracle" else mode
    scheduler = make_scheduler(engine_mode, model, num_blocks=num_blocks, **kwargs)
    tracker = cached_block_tracker(scheduler)
    retention = retention_of(scheduler.kv_cache_manager.block_pool)  # None for align
    owner: dict = {}  # block hash -> "request@position" of the first request that hashed it
    flags: dict = {}  # block hash -> the state's flags after the previous step
    lines: list[str] = []
    seen = 0  # evictions already printed
    step = 0

    def observe(output, live) -> None:
        nonlocal seen, step
        # Runs right after schedule(): the evictions since the last call are this step's.
        for group, block_hash, reason in tracker.evictions[seen:]:
            reason = "oracle" if mode == "oracle" and reason != "lru" else reason  # no policy reason
            kind = "state" if group in tracker.mamba_group_ids else "attention"
            note = f" [{flags.get(block_hash, '?')}]" if kind == "state" and reason != "lru" else ""
            lines.append(f"    evicted {kind} page g{group} of {owner.get(block_hash, '?')}: {reason}{note}")
        seen = len(tracker.evictions)
        chunks = " ".join(f"{rid}:{live[rid].num_computed_tokens - n}+{n}"
                          for rid, n in output.num_scheduled_tokens.items())
        preempted = sorted(getattr(output, "preempted_req_ids", None) or ())
        if chunks or preempted:
            lines.append(f"step {step}: {chunks}" + (f"  preempted {preempted}" if preempted else ""))
        for rid, request in live.items():
            for index, block_hash in enumerate(request.block_hashes):
                owner.setdefault(block_hash, f"{rid}@{(index + 1) * block_size}")
        if retention is not None:
            for block_hash, node in retention.tree.nodes.items():
                flags[block_hash] = node_flags(node)
        step += 1

    if mode == "oracle":
        import benchmark_oracle_eviction

        result = benchmark_oracle_eviction.replay_with_oracle(
            requests, model, num_blocks, observers=[observe], scheduler=scheduler, **kwargs)
    else:
        result = replay(mode, requests, model, max_steps=20_000, observers=[observe], scheduler=scheduler)
    hits = " ".join(f"{rid}={n}" for rid, n in sorted(result.cached_per_request.items()))
    lines.append(f"hit tokens: {result.cached_tokens} ({hits}); preemptions {result.preemptions}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True, help="the trace (history_trace(seed))")
    parser.add_argument("--pool", type=int, required=True, help="pool size in blocks")
    parser.add_argument("--modes", default="align,lighter:inside")
    parser.add_argument("--model", default=".tiny_models/qwen3_next", help="hybrid model dir (config only)")
    args = parser.parse_args(argv)
    from vllm_lighter_mamba.bench.sim import MODES, split_modes
    from vllm_lighter_mamba.bench.workloads import history_trace

    requests, kwargs, pools = history_trace(args.seed)
    print(f"seed {args.seed}: {kwargs}; the suite's pools {pools[:6]}")
    print("\n".join(describe_trace(requests)))
    for mode in split_modes(args.modes, (*MODES, "oracle")):
        print(f"\n== {mode}, {args.pool} blocks")
        print("\n".join(explain(mode, requests, args.model, args.pool, kwargs)))


if __name__ == "__main__":
    main()
