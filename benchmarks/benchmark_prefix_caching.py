"""Prefix-caching benchmark for hybrid models: prefix caching off, vLLM's Mamba cache modes
and the lighter cache, on the same workloads, with ratios to the first mode.

Engine mode (default) runs vLLM's offline ``LLM`` (any EngineArgs: ``--model`` ...), one fresh
process per mode. ``--simulate`` replays the same workloads through vLLM's real Scheduler and
KVCacheManager with a mocked model (no weights, no device).

    python benchmarks/benchmark_prefix_caching.py --model DIR --compare none,align,lighter \\
        --workload shared-prefix,divergent --output-json out.json --plot out.png
    python benchmarks/benchmark_prefix_caching.py --simulate --model DIR --num-prompts 10000 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

MODES = ("none", "all", "align", "lighter")


def benchmark_parser() -> argparse.ArgumentParser:
    """The benchmark's own options (``--help`` shows these; vLLM is not imported for it)."""
    from vllm_lighter_mamba.bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s --model DIR [benchmark options] [vLLM engine arguments]",
        epilog="Every other option is a vLLM engine argument (EngineArgs, as for `vllm serve`: "
        "--block-size, --max-num-batched-tokens, --enforce-eager, ...). --mamba-cache-mode "
        "picks one mode: none (prefix caching off), all, align, lighter (default).",
    )
    add = parser.add_argument
    add("--compare", default=None, help="comma list of modes (none, all, align, lighter); "
        "ratios are to the first")
    add("--workload", default="shared-prefix", help=f"comma list of: {', '.join(WORKLOADS)}")
    add("--num-prompts", type=int, default=16, help="requests per workload")
    add("--repeat-count", type=int, default=2, help="repeat: times each prompt is sent")
    add("--prefix-len", type=int, default=1024, help="tokens of a shared prefix")
    add("--input-length-range", default="64:256", help="MIN:MAX unique suffix tokens")
    add("--output-len", type=int, default=16, help="generated tokens per request")
    add("--num-turns", type=int, default=3, help="multi-turn: turns per conversation")
    add("--trace", help="JSONL trace instead of a workload: arrival, prompt_token_ids, output_len")
    add("--dataset-path", help="same as --trace")
    add("--simulate", action="store_true",
        help="replay through vLLM's real scheduler with a mocked model (no weights, no device)")
    add("--sim-block-size", type=int, default=None, help="--simulate: block size (default 256)")
    add("--sim-num-blocks", type=int, default=20_000, help="--simulate: KV-cache blocks")
    add("--results-dir", help="engine mode: keep each mode's raw results in DIR/<mode>.json and "
        "reuse them instead of re-running that mode (long engine starts)")
    add("--show-requests", action="store_true",
        help="also print one row per request: wave, cached and lost-hit tokens, TTFT")
    add("--output-json", help="write summaries and per-request records here")
    add("--plot", help="write a hit-rate / TTFT plot (PNG) here")
    add("--worker-mode", action="store_true", help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    args, rest = benchmark_parser().parse_known_args(argv)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    engine = EngineArgs.add_cli_args(FlexibleArgumentParser(add_help=False))
    # EngineArgs' --mamba-cache-mode, widened: none = prefix caching off, all/align = vLLM's
    # modes, lighter = VLLM_USE_LIGHTER_MAMBA_CACHE=1.
    for action in engine._actions:
        if action.dest == "mamba_cache_mode":
            action.choices, action.type = MODES, str
    engine.set_defaults(seed=0, mamba_cache_mode=None)
    return engine.parse_args(rest, namespace=args)


def workload_spec(args):
    from vllm_lighter_mamba.bench.workloads import WorkloadSpec

    low, high = (int(x) for x in args.input_length_range.split(":"))
    return WorkloadSpec(
        num_prompts=args.num_prompts,
        repeat_count=args.repeat_count,
        prefix_len=args.prefix_len,
        input_length_range=(low, high),
        output_len=args.output_len,
        seed=args.seed or 0,
        num_turns=args.num_turns,
    )


def sources(args):
    """(workload name, wave source) pairs; a fresh source per call (they are consumed)."""
    from vllm_lighter_mamba.bench.workloads import from_list, trace_waves, wave_source

    trace = args.trace or args.dataset_path
    if trace:
        return [("trace", from_list(trace_waves(trace)))]
    spec = workload_spec(args)
    return [(name, wave_source(name, spec)) for name in args.workload.split(",")]


def modes_of(args) -> list[str]:
    modes = args.compare.split(",") if args.compare else [args.mamba_cache_mode or "lighter"]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; expected {', '.join(MODES)}")
    return modes


def engine_kwargs(args, mode: str) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: v for k, v in vars(args).items() if k in fields}
    kwargs["mamba_cache_mode"] = "none"
    kwargs["disable_log_stats"] = False  # per-request TTFT comes from the engine's stats
    if mode == "none":
        kwargs["enable_prefix_caching"] = False
    elif mode in ("all", "align"):
        kwargs["enable_prefix_caching"] = True
        kwargs["mamba_cache_mode"] = mode
    return kwargs


def worker(args) -> None:
    """One mode in this (fresh) process: the variable was set by the parent."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from vllm_lighter_mamba.bench.runners import run_engine

    mode = args.mamba_cache_mode
    # Only what the user set (LLM has its own defaults), plus what the mode pins.
    pinned = {"disable_log_stats", "enable_prefix_caching", "mamba_cache_mode"}
    llm = LLM(**{k: v for k, v in engine_kwargs(args, mode).items()
                 if k in pinned or v != getattr(EngineArgs, k, object())})
    results = [run_engine(llm, mode, name, source).to_json() for name, source in sources(args)]
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    with open(args.output_json, "w") as f:
        json.dump({"block_size": block_size, "results": results}, f)


def run_engine_mode(argv: list[str], mode: str) -> dict:
    env = dict(os.environ)
    env["VLLM_USE_LIGHTER_MAMBA_CACHE"] = "1" if mode == "lighter" else "0"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "mode.json")
        command = [sys.executable, os.path.abspath(__file__), *strip_parent_flags(argv),
                   "--worker-mode", "--mamba-cache-mode", mode, "--output-json", out]
        subprocess.run(command, env=env, check=True)
        with open(out) as f:
            return json.load(f)


def run_engine_mode_cached(argv: list[str], mode: str, results_dir: str | None) -> dict:
    """``run_engine_mode``, or its saved results from an earlier run with the same flags."""
    if not results_dir:
        return run_engine_mode(argv, mode)
    path = os.path.join(results_dir, f"{mode}.json")
    flags = strip_parent_flags(argv)
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("argv") == flags:
            print(f"# {mode}: results from {path}")
            return saved
        print(f"# {mode}: {path} came from other flags; running again")
    run = run_engine_mode(argv, mode)
    os.makedirs(results_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump({**run, "argv": flags}, f)
    return run


def strip_parent_flags(argv: list[str]) -> list[str]:
    """The parent's flags minus those the worker gets anew."""
    # (--show-requests has no value and only affects the parent's printing: harmless.)
    drop_with_value = {"--compare", "--mamba-cache-mode", "--output-json", "--plot", "--results-dir"}
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop_with_value:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept


def simulate(args, modes: list[str]) -> list[dict]:
    from vllm_lighter_mamba.bench.runners import run_simulated

    block_size = args.sim_block_size or args.block_size or 256
    results = []
    for mode in modes:
        if mode == "all":
            print("--simulate: skipping mode 'all' (its layout needs the model's kernels)")
            continue
        for name, source in sources(args):
            result = run_simulated(
                mode, name, source, args.model,
                block_size=block_size,
                num_blocks=args.sim_num_blocks,
                max_num_batched_tokens=args.max_num_batched_tokens or 2048,
                max_num_seqs=args.max_num_seqs or 256,
                max_model_len=args.max_model_len or 8192,
            )
            results.append(result.to_json())
    return results


def add_ratios(summaries: list[dict]) -> None:
    """Ratios to the first mode of the same workload, and greedy-output agreement."""
    first: dict[str, dict] = {}
    for s in summaries:
        base = first.setdefault(s["workload"], s)
        for key in ("hit_rate", "cached_tokens", "wall_s", "ttft_p50_s", "ttft_p99_s", "output_tok_s",
                    "decode_tok_s", "peak_blocks", "mean_blocks"):
            if s.get(key) is not None and base.get(key):
                s[f"{key}_ratio"] = s[key] / base[key]


def add_agreement(results: list[dict]) -> None:
    first: dict[str, dict] = {}
    for r in results:
        base = first.setdefault(r["summary"]["workload"], r)
        ours = {q["request_id"]: q["output_token_ids"] for q in r["requests"]}
        theirs = {q["request_id"]: q["output_token_ids"] for q in base["requests"]}
        same = sum(ours[k] == theirs.get(k) for k in ours)
        r["summary"]["output_agreement"] = same / len(ours) if ours else 1.0


def print_table(summaries: list[dict]) -> None:
    columns = ["workload", "mode", "hit_rate", "cached_tokens", "prompt_tokens", "wall_s", "ttft_p50_s",
               "ttft_p99_s", "output_tok_s", "decode_tok_s", "peak_blocks", "mean_blocks", "steps",
               "lost_hit_tokens", "output_agreement", "hit_rate_ratio", "ttft_p50_s_ratio",
               "decode_tok_s_ratio", "peak_blocks_ratio"]
    columns = [c for c in columns if any(s.get(c) is not None for s in summaries)]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for s in summaries:
        cells = []
        for c in columns:
            v = s.get(c)
            cells.append("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def print_requests(results: list[dict]) -> None:
    """Per request, so a miss can be traced to its request: which wave, how much was cached
    and (--simulate) how much the attention KV had but no Mamba state covered."""
    print("| mode | workload | wave | request | prompt_tokens | cached_tokens | lost_hit_tokens | ttft_s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["summary"]
        for q in r["requests"]:
            lost = "" if q.get("lost_hit_tokens") is None else q["lost_hit_tokens"]
            ttft = "" if q.get("ttft_s") is None else f"{q['ttft_s']:.4g}"
            print(f"| {s['mode']} | {s['workload']} | {q['wave']} | {q['request_id']} | {q['prompt_tokens']} "
                  f"| {q['cached_tokens']} | {lost} | {ttft} |")


def cell(summaries: list[dict], workload: str, mode: str, key: str) -> float:
    match = [s for s in summaries if s["workload"] == workload and s["mode"] == mode]
    return (match[0].get(key) or 0.0) if match else 0.0


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(s["workload"] for s in summaries))
    modes = list(dict.fromkeys(s["mode"] for s in summaries))
    has_ttft = any(s.get("ttft_p50_s") is not None for s in summaries)
    fig, axes = plt.subplots(1, 2 if has_ttft else 1, figsize=(12 if has_ttft else 6, 4), squeeze=False)
    width = 0.8 / len(modes)
    for panel, (key, label) in enumerate([("hit_rate", "token hit rate"), ("ttft_p50_s", "TTFT p50 (s)")]):
        if panel == 1 and not has_ttft:
            break
        ax = axes[0][panel]
        for m, mode in enumerate(modes):
            values = [cell(summaries, w, mode, key) for w in workloads]
            ax.bar([i + m * width for i in range(len(workloads))], values, width, label=mode)
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(workloads))], workloads)
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker_mode:
        worker(args)
        return
    modes = modes_of(args)
    if args.simulate:
        results = simulate(args, modes)
        block_size = args.sim_block_size or args.block_size or 256
    else:
        results, block_size = [], None
        for mode in modes:
            run = run_engine_mode_cached(argv, mode, args.results_dir)
            block_size = run["block_size"]
            results.extend(run["results"])
    add_agreement(results)
    summaries = [r["summary"] for r in results]
    add_ratios(summaries)
    print(f"# block size {block_size}; {'simulated' if args.simulate else 'engine'}; modes {modes}")
    print_table(summaries)
    if args.show_requests:
        print_requests(results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            # Per request: hits and timings; the generated tokens only served the agreement check.
            requests = {
                f"{r['summary']['mode']}/{r['summary']['workload']}": [
                    {k: v for k, v in q.items() if k != "output_token_ids"} for q in r["requests"]
                ]
                for r in results
            }
            report = {"block_size": block_size, "simulate": args.simulate, "argv": argv,
                      "results": summaries, "requests": requests}
            json.dump(report, f)
    if args.plot:
        plot(summaries, args.plot)


if __name__ == "__main__":
    main()
