"""Prefix-caching benchmark for hybrid models: prefix caching off, vLLM's Mamba cache modes
and the lighter cache, on the same workloads, with ratios to the first mode.

Engine mode (default) runs vLLM's offline ``LLM`` (any EngineArgs: ``--model`` ...), one fresh
process per mode. ``--simulate`` replays the same workloads through vLLM's real Scheduler and
KVCacheManager with a mocked model (no weights, no device).

    python benchmarks/benchmark_prefix_caching.py --model DIR --compare none,align,lighter \\
        --workload shared-prefix,divergent --output-json out.json --plot out.png
    python benchmarks/benchmark_prefix_caching.py --simulate --model DIR --num-prompts 10000 ...
    python benchmarks/benchmark_prefix_caching.py --simulate --model DIR --workload multi-prefix \\
        --sim-num-blocks 600,800,1200,100000 --plot sweep.png     # hit rate against pool size
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
    add("--num-turns", type=int, default=3, help="multi-turn, multi-turn-sessions: turns per conversation")
    add("--num-prefixes", type=int, default=48,
        help="multi-prefix, multi-turn-sessions: system prompts (lengths --prefix-len x 0.5..1.5)")
    add("--zipf-s", type=float, default=1.0, help="multi-prefix: Zipf exponent of system-prompt popularity")
    add("--arrival-rate", type=float, default=1.0,
        help="open workloads, --simulate: requests per scheduler step (Poisson)")
    add("--think-steps", default="0:50",
        help="multi-turn-sessions, --simulate: MIN:MAX steps between a reply and the next turn")
    add("--trace", help="JSONL trace instead of a workload: arrival, prompt_token_ids, output_len")
    add("--dataset-path", help="same as --trace")
    add("--simulate", action="store_true",
        help="replay through vLLM's real scheduler with a mocked model (no weights, no device)")
    add("--sim-block-size", type=int, default=None, help="--simulate: block size (default 256)")
    add("--sim-num-blocks", default="20000",
        help="--simulate: KV-cache blocks, or a comma list to sweep (the largest is the 'unlimited' "
        "reference; --plot then draws hit rate against pool size)")
    add("--sim-mamba-groups", type=int, default=None,
        help="--simulate: Mamba KV-cache groups, i.e. pages per cached state (default: as vLLM groups "
        "the model's layers, e.g. 3 for Qwen3-Next-80B; 1 if it cannot tell)")
    add("--sim-speculative-tokens", type=int, default=0,
        help="--simulate: draft tokens per decode step, a random number of them accepted (the "
        "replay's speculative decoding; synchronous scheduling)")
    add("--sim-hash-after-output", action="store_true",
        help="--simulate: hash after every output as vLLM's async scheduler does (its default); "
        "the replay itself schedules synchronously")
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
    think_low, think_high = (int(x) for x in args.think_steps.split(":"))
    return WorkloadSpec(
        num_prompts=args.num_prompts,
        repeat_count=args.repeat_count,
        prefix_len=args.prefix_len,
        input_length_range=(low, high),
        output_len=args.output_len,
        seed=args.seed or 0,
        num_turns=args.num_turns,
        num_prefixes=args.num_prefixes,
        zipf_s=args.zipf_s,
        arrival_rate=args.arrival_rate,
        think_steps=(think_low, think_high),
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
    """The modes to run; --simulate also takes lighter:off (no retention policy: vLLM's LRU
    eviction order) and lighter:alpha=X,share=Y (other settings)."""
    from vllm_lighter_mamba.bench.sim import split_modes

    modes = split_modes(args.compare) if args.compare else [args.mamba_cache_mode or "lighter"]
    for mode in modes:
        if mode in MODES:
            continue
        if args.simulate and mode.startswith("lighter:"):
            from vllm_lighter_mamba.bench.sim import parse_mode

            try:
                parse_mode(mode)
            except ValueError as error:
                raise SystemExit(str(error)) from None
            continue
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


def pool_sizes(args) -> list[int]:
    return [int(x) for x in str(args.sim_num_blocks).split(",")]


def simulate(args, modes: list[str]) -> list[dict]:
    from vllm_lighter_mamba.bench.runners import run_simulated
    from vllm_lighter_mamba.bench.sim import Speculation, model_mamba_groups

    block_size = args.sim_block_size or args.block_size or 256
    mamba_groups = args.sim_mamba_groups or model_mamba_groups(args.model)
    drafts = args.sim_speculative_tokens
    replay_options = {"speculation": Speculation(drafts, seed=args.seed or 0),
                      "num_speculative_blocks": drafts} if drafts else {}
    if args.sim_hash_after_output:
        replay_options["hash_after_output"] = True
    results = []
    for num_blocks in pool_sizes(args):
        for mode in modes:
            if mode == "all":
                print("--simulate: skipping mode 'all' (its layout needs the model's kernels)")
                continue
            for name, source in sources(args):
                result = run_simulated(
                    mode, name, source, args.model,
                    block_size=block_size,
                    num_blocks=num_blocks,
                    num_mamba_groups=mamba_groups,
                    max_num_batched_tokens=args.max_num_batched_tokens or 2048,
                    max_num_seqs=args.max_num_seqs or 256,
                    max_model_len=args.max_model_len or 8192,
                    **replay_options,
                )
                results.append(result.to_json())
    return results


def case(summary: dict) -> tuple:
    """What a mode is compared within: the workload (and the pool size of a sweep)."""
    return summary["workload"], summary.get("num_blocks")


def add_ratios(summaries: list[dict]) -> None:
    """Ratios to the first mode of the same workload (and pool size)."""
    first: dict[tuple, dict] = {}
    for s in summaries:
        base = first.setdefault(case(s), s)
        for key in ("hit_rate", "cached_tokens", "wall_s", "ttft_p50_s", "ttft_p99_s", "output_tok_s",
                    "decode_tok_s", "peak_blocks", "mean_blocks"):
            if s.get(key) is not None and base.get(key):
                s[f"{key}_ratio"] = s[key] / base[key]


def add_agreement(results: list[dict]) -> None:
    """Greedy-output agreement with the first mode of the same workload (and pool size)."""
    first: dict[tuple, dict] = {}
    for r in results:
        base = first.setdefault(case(r["summary"]), r)
        ours = {q["request_id"]: q["output_token_ids"] for q in r["requests"]}
        theirs = {q["request_id"]: q["output_token_ids"] for q in base["requests"]}
        same = sum(ours[k] == theirs.get(k) for k in ours)
        r["summary"]["output_agreement"] = same / len(ours) if ours else 1.0


def print_table(summaries: list[dict]) -> None:
    columns = ["workload", "mode", "num_blocks", "hit_rate", "cached_tokens", "prompt_tokens", "wall_s",
               "ttft_p50_s", "ttft_p99_s", "output_tok_s", "decode_tok_s", "peak_blocks", "mean_blocks",
               "cached_state_peak", "cached_state_mean", "cached_attn_peak", "cached_attn_mean",
               "evicted_blocks", "preemptions", "steps", "lost_hit_tokens", "output_agreement",
               "hit_rate_ratio", "ttft_p50_s_ratio", "decode_tok_s_ratio", "peak_blocks_ratio"]
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


def sweep_report(summaries: list[dict], pressure: float = 0.8) -> dict:
    """Hit rate against pool size, per workload: each mode's rate, align's share of its
    rate in the largest pool ('unlimited'), and every mode's ratio to align. Pool sizes where
    align keeps at most ``pressure`` of its unlimited rate are the 'pressure' points.

    A mode's 'ceiling' at a pool size is its own unlimited rate over align's rate there: the
    ratio it would reach if pressure cost it no hit. No eviction order goes beyond it (it
    only chooses which of the states the mode caches survive), so a target ratio above the
    ceiling asks for more states, not a better order: where align keeps a share f of a
    ceiling equal to its own, the most any order reaches is 1 / f."""
    report: dict = {}
    for workload in dict.fromkeys(s["workload"] for s in summaries):
        rows = [s for s in summaries if s["workload"] == workload and s.get("num_blocks") is not None]
        sizes = sorted({s["num_blocks"] for s in rows})
        modes = list(dict.fromkeys(s["mode"] for s in rows))
        rate = {(s["mode"], s["num_blocks"]): s["hit_rate"] for s in rows}
        evicted = {(s["mode"], s["num_blocks"]): s.get("evicted_blocks") for s in rows}
        base = "align" if "align" in modes else modes[0]
        unlimited = rate.get((base, sizes[-1]), 0.0)
        points = []
        for size in sizes:
            point = {"num_blocks": size, "hit_rate": {m: rate.get((m, size)) for m in modes}}
            if unlimited:
                point[f"{base}_retained"] = rate.get((base, size), 0.0) / unlimited
            denominator = rate.get((base, size)) or 0.0
            point["ratio_to_" + base] = {
                m: (rate[(m, size)] / denominator if denominator else None)
                for m in modes
                if (m, size) in rate
            }
            point["ceiling_to_" + base] = {
                m: (rate[(m, sizes[-1])] / denominator if denominator and (m, sizes[-1]) in rate else None)
                for m in modes
            }
            point["pressure"] = bool(unlimited) and rate.get((base, size), 0.0) <= pressure * unlimited
            points.append(point)
        report[workload] = {
            "base": base,
            "unlimited_num_blocks": sizes[-1],
            "unlimited_evicted_blocks": {m: evicted.get((m, sizes[-1])) for m in modes},
            "points": points,
        }
    return report


def print_sweep(report: dict) -> None:
    for workload, sweep in report.items():
        base = sweep["base"]
        modes = list(sweep["points"][0]["hit_rate"])
        print(f"# {workload}: hit rate against pool size (blocks); ratios to {base}; "
              f"'pressure' = {base} keeps <= 80% of its rate at {sweep['unlimited_num_blocks']} blocks")
        others = [m for m in modes if m != base]
        print("| num_blocks | " + " | ".join(modes) + f" | {base} retained | "
              + " | ".join(f"{m} / {base}" for m in others)
              + " | " + " | ".join(f"{m} ceiling" for m in others) + " | pressure |")
        print("|---" * (len(modes) + 2 * len(others) + 3) + "|")
        for p in sweep["points"]:
            rates = " | ".join("" if p["hit_rate"][m] is None else f"{p['hit_rate'][m]:.4f}" for m in modes)
            ratio = p["ratio_to_" + base]
            ratios = " | ".join("" if ratio.get(m) is None else f"{ratio[m]:.3f}" for m in others)
            ceiling = p["ceiling_to_" + base]
            ceilings = " | ".join("" if ceiling.get(m) is None else f"{ceiling[m]:.3f}" for m in others)
            retained = p.get(f"{base}_retained")
            print(f"| {p['num_blocks']} | {rates} | {'' if retained is None else f'{retained:.3f}'} | "
                  f"{ratios} | {ceilings} | {'yes' if p['pressure'] else ''} |")


def plot_sweep(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report), figsize=(6 * len(report), 4), squeeze=False)
    for ax, (workload, sweep) in zip(axes[0], report.items(), strict=True):
        sizes = [p["num_blocks"] for p in sweep["points"]]
        for mode in sweep["points"][0]["hit_rate"]:
            ax.plot(sizes, [p["hit_rate"][mode] for p in sweep["points"]], marker="o", label=mode)
        ax.set_xscale("log")
        ax.set_xlabel("pool size (blocks)")
        ax.set_ylabel("token hit rate")
        ax.set_title(workload)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


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
    sweep = sweep_report(summaries) if args.simulate and len(pool_sizes(args)) > 1 else None
    print(f"# block size {block_size}; {'simulated' if args.simulate else 'engine'}; modes {modes}")
    print_table(summaries)
    if sweep:
        print_sweep(sweep)
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
            if sweep:
                report["sweep"] = sweep
            json.dump(report, f)
    if args.plot:
        if sweep:
            plot_sweep(sweep, args.plot)
        else:
            plot(summaries, args.plot)


if __name__ == "__main__":
    main()
