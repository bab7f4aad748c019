"""Replay what one ``benchmark_serving.py --concurrent`` server is sent through vLLM's real
scheduler and KV-cache manager with a mocked model (``bench.sim``): hit rates per workload and
round, per mode, in seconds of CPU instead of a GPU.

One server of a concurrent run gets, in order: a warm-up pass of every workload (seed 10000),
then every workload of round 0, then of round 1, ... on one prefix cache. The replay sends
the same requests (one character is one token under the byte-level tokenizer of
``bench.tiny_models``, as on the device) in the same order, with their Poisson arrivals turned
into scheduler steps at ``--step-ms`` per step, each workload after the previous one's last
arrival plus ``--gap-steps``; scheduling is asynchronous (vLLM's default for ``vllm serve``).
Arrival times are approximate, so the replay reproduces which states the cache holds, not
timings. Take the pool and block size from the server's log ("num_gpu_blocks", "block size").
Per workload, round and mode it prints the token hit rate and the prefill steps per request
(engine steps that computed part of the request's prompt): on a model whose prefill step costs
about the same at any length, TTFT follows the steps. Modes: those of
``benchmark_prefill_steps.py``, e.g. ``none`` (caching off) and ``align:triton`` (align where
the GDN prefill runs on Triton, as on a host without FlashInfer or on the CPU: the chunk is cut
at the prompt's last boundary instead of the state being written from inside the forward).

    python benchmarks/replay_serving.py --model .tiny_models/qwen3_next-<version> \\
        --replay-modes align,lighter --replay-block-size 576 --replay-num-blocks 455 \\
        [benchmark_serving.py workload flags: --workloads system:16384,multi_turn --chats 8 ...]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark_prefill_steps  # noqa: E402
import benchmark_serving  # noqa: E402

from vllm_lighter_mamba.bench import serving_workloads  # noqa: E402

WARMUP_SEED = 10_000  # benchmark_serving's warm-up pass


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this script's options, ``benchmark_serving.py``'s workload options)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    p.add_argument("--replay-modes", default="align,lighter",
                   help="benchmark_prefill_steps.py modes (none, align, align:triton, lighter:OPTIONS)")
    p.add_argument("--replay-block-size", type=int, default=576)
    p.add_argument("--replay-num-blocks", type=int, default=455)
    p.add_argument("--replay-mamba-groups", type=int, default=3)
    p.add_argument("--replay-max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--replay-max-num-seqs", type=int, default=128)
    p.add_argument("--replay-max-model-len", type=int, default=32768)
    p.add_argument("--step-ms", type=float, default=20.0, help="seconds of arrival time per scheduler step")
    p.add_argument("--gap-steps", type=int, default=2000, help="steps between one workload and the next")
    p.add_argument("--output-json")
    ours, rest = p.parse_known_args(argv)
    return ours, benchmark_serving.parse_args(rest)


def server_sequence(args: argparse.Namespace) -> list[tuple[str, int, serving_workloads.Workload]]:
    """(workload name, round or -1 for the warm-up, requests) in the order one server gets them."""
    names = [n for n in args.workloads.split(",") if n.partition(":")[0] in benchmark_serving.CUSTOM]
    out = [(n, -1, serving_workloads.warm_up_of(benchmark_serving.custom_workload(args, n, WARMUP_SEED),
                                                args.warmup_fraction)) for n in names]
    for round_ in range(args.rounds):
        out += [(n, round_, benchmark_serving.custom_workload(args, n, args.seed + round_)) for n in names]
    return out


def arrival_steps(
    workload: serving_workloads.Workload, start: int, step_ms: float, seed: int = 0
) -> list[int]:
    """Poisson arrivals at the workload's rate (all at ``start`` if it has none), in steps."""
    rng, t, steps = random.Random(seed), 0.0, []
    for _ in workload.requests:
        if workload.request_rate:
            t += rng.expovariate(workload.request_rate)
        steps.append(start + int(t * 1000 / step_ms))
    return steps


def main(argv: list[str] | None = None) -> None:
    ours, args = parse_args(argv)
    from vllm_lighter_mamba.bench.sim import SimRequest, replay, split_modes

    segments, requests, step = [], [], 0
    for name, round_, workload in server_sequence(args):
        steps = arrival_steps(workload, step, ours.step_ms)
        first = len(requests)
        for i, (request, arrival) in enumerate(zip(workload.requests, steps, strict=True)):
            requests.append(SimRequest(f"{len(segments)}-{i}", [ord(c) for c in request["prompt"]],
                                       request["output_tokens"], arrival_step=arrival))
        segments.append((name, round_, first, len(requests)))
        step = max(steps, default=step) + ours.gap_steps
    rows = []
    for mode in split_modes(ours.replay_modes):
        sim_mode, options = benchmark_prefill_steps.parse_mode(mode)
        result = replay(
            sim_mode, requests, args.model, overlap=True, async_scheduling=True,
            block_size=ours.replay_block_size, num_blocks=ours.replay_num_blocks,
            num_mamba_groups=ours.replay_mamba_groups,
            max_num_batched_tokens=ours.replay_max_num_batched_tokens,
            max_num_seqs=ours.replay_max_num_seqs, max_model_len=ours.replay_max_model_len,
            **options,
        )
        steps = {stats.request_id: stats.steps for stats in benchmark_prefill_steps.prefill_stats(
            result.chunks, {r.request_id: len(r.prompt_token_ids) for r in requests}, {})}
        for name, round_, first, last in segments:
            chosen = requests[first:last]
            prompt = sum(len(r.prompt_token_ids) for r in chosen)
            cached = sum(result.cached_per_request.get(r.request_id, 0) for r in chosen)
            rows.append({"mode": mode, "workload": name, "round": round_, "hit_rate": cached / prompt,
                         "prefill_steps_per_request": sum(steps[r.request_id] for r in chosen) / len(chosen)})
    modes = split_modes(ours.replay_modes)
    print("| workload | round | " + " | ".join(f"{m} hits | {m} prefill steps/req" for m in modes) + " |")
    print("|---|---|" + "---|---|" * len(modes))
    for name, round_, _, _ in segments:
        cells = [f"{r['hit_rate']:.3f} | {r['prefill_steps_per_request']:.2f}" for r in rows
                 if r["workload"] == name and r["round"] == round_]
        print(f"| {name} | {'warm-up' if round_ < 0 else round_} | " + " | ".join(cells) + " |")
    if ours.output_json:
        record = {"args": vars(args), "replay": vars(ours), "rows": rows}
        Path(ours.output_json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
