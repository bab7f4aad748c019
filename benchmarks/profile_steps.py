"""A step timeline from vLLM's torch-profiler traces (``vllm serve --profiler-config``).

vLLM's worker wraps each ``execute_model`` in an annotation named
``execute_context_N(T)_generation_M(U)``: N requests with T prompt tokens and M decoding
requests with U tokens in that engine step. This script reads a worker trace
(``*.pt.trace.json.gz``) and reports, per kind of step (``prefill``: N > 0, ``decode``:
N == 0): how many, their host time (the annotation), their GPU time (the same annotation on
the GPU timeline) and their period (one step's start to the next one's, which adds the
scheduler and the sampling between them); the host operations inside steps (aten ops, CUDA
runtime calls such as synchronizations and copies, kernel launches) per step; and the GPU
kernels by total time. Given several traces (one per mode) it prints them side by side.
``--list-prefill N`` also lists each trace's first N prefill steps in order (which steps a
prompt's prefill took, and what each cost), e.g. a cold prompt's chunks.

    python benchmarks/profile_steps.py PROFILE_DIR/align PROFILE_DIR/lighter [--output-json F] \
        [--list-prefill N]

A directory stands for its newest worker trace (the front end's trace, if any, is skipped).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path

STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
TOP = 25


def find_trace(path: Path) -> Path:
    """The trace of PATH: a file, or the newest worker trace in a directory."""
    if path.is_file():
        return path
    traces = [p for p in path.rglob("*.pt.trace.json*") if "async_llm" not in p.name.lower()]
    if not traces:
        raise FileNotFoundError(f"no *.pt.trace.json[.gz] under {path}")
    return max(traces, key=lambda p: p.stat().st_mtime)


def load_events(trace: Path) -> list[dict]:
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _stats(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    return {"count": len(values), "median": statistics.median(values), "mean": statistics.fmean(values),
            "total": sum(values)}


def step_timeline(events: list[dict]) -> dict:
    """The summary of one trace (see the module docstring); times in ms."""
    host_steps = sorted((e for e in events if e.get("cat") == "user_annotation" and STEP.match(e["name"])),
                        key=lambda e: e["ts"])
    gpu_steps = sorted((e for e in events if e.get("cat") == "gpu_user_annotation" and STEP.match(e["name"])),
                       key=lambda e: e["ts"])
    if not host_steps:
        raise ValueError("no execute_context_..._generation_... annotations: not a worker trace of a "
                         "profiled run")
    # The GPU annotations of the steps, in order, by name (a step's GPU range carries its name).
    gpu_by_name: dict[str, list[float]] = defaultdict(list)
    for e in gpu_steps:
        gpu_by_name[e["name"]].append(e["dur"] / 1000)
    kinds: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in ("prefill", "decode")}
    prefill_steps: list[dict] = []  # in order, for --list-prefill
    taken: Counter = Counter()
    for i, step in enumerate(host_steps):
        ctx, ctx_tokens, gen, gen_tokens = map(int, STEP.match(step["name"]).groups())
        kind = kinds["prefill" if ctx else "decode"]
        kind["host_ms"].append(step["dur"] / 1000)
        kind["tokens"].append(ctx_tokens + gen_tokens)
        period = (host_steps[i + 1]["ts"] - step["ts"]) / 1000 if i + 1 < len(host_steps) else None
        if period is not None:
            kind["period_ms"].append(period)
        if ctx:
            prefill_steps.append({"start_ms": (step["ts"] - host_steps[0]["ts"]) / 1000,
                                  "prefill_requests": ctx, "prefill_tokens": ctx_tokens,
                                  "decode_requests": gen, "host_ms": step["dur"] / 1000,
                                  "period_ms": period})
        durations = gpu_by_name.get(step["name"], [])
        if taken[step["name"]] < len(durations):
            kind["gpu_ms"].append(durations[taken[step["name"]]])
            taken[step["name"]] += 1
    starts = [s["ts"] for s in host_steps]
    thread = (host_steps[0]["pid"], host_steps[0]["tid"])

    def step_of(e: dict) -> int | None:
        """The index of the step whose host range holds E (same thread), else None."""
        if (e.get("pid"), e.get("tid")) != thread:
            return None
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] + e["dur"] <= host_steps[i]["ts"] + host_steps[i]["dur"]:
            return i
        return None

    host_ops: dict[str, list[float]] = defaultdict(list)
    outside_steps: dict[str, list[float]] = defaultdict(list)
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in events:
        cat = e.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[e["name"][:120]].append(e["dur"] / 1000)
        elif cat in ("cpu_op", "cuda_runtime", "cuda_driver"):
            target = host_ops if step_of(e) is not None else outside_steps
            target[f"{cat}:{e['name'][:100]}"].append(e["dur"] / 1000)
    n = len(host_steps)

    def top(table: dict[str, list[float]]) -> list[dict]:
        rows = [{"name": k, "count": len(v), "total_ms": sum(v), "per_step": len(v) / n}
                for k, v in table.items()]
        return sorted(rows, key=lambda r: -r["total_ms"])[:TOP]

    window_ms = (host_steps[-1]["ts"] + host_steps[-1]["dur"] - host_steps[0]["ts"]) / 1000
    return {
        "steps": n,
        "window_ms": window_ms,
        "kinds": {k: {name: _stats(v) for name, v in table.items()} for k, table in kinds.items()},
        "prefill_steps": prefill_steps,
        "host_ops_in_steps": top(host_ops),
        "host_ops_between_steps": top(outside_steps),
        "kernels": top(kernels),
    }


def print_side_by_side(summaries: dict[str, dict]) -> None:
    labels = list(summaries)
    print("| per step | " + " | ".join(labels) + " |")
    print("|---" * (1 + len(labels)) + "|")
    for kind in ("prefill", "decode"):
        for name in ("host_ms", "gpu_ms", "period_ms", "tokens"):
            cells = []
            for label in labels:
                s = summaries[label]["kinds"][kind].get(name, {"count": 0})
                cells.append("-" if not s["count"] else f"{s['median']:.3f} (n={s['count']})")
            print(f"| {kind} {name} median | " + " | ".join(cells) + " |")
    for section in ("host_ops_in_steps", "host_ops_between_steps", "kernels"):
        print(f"\n## {section}: total ms (per step)")
        names: list[str] = []
        for label in labels:
            names += [r["name"] for r in summaries[label][section] if r["name"] not in names]
        print("| name | " + " | ".join(labels) + " |")
        print("|---" * (1 + len(labels)) + "|")
        for name in names:
            cells = []
            for label in labels:
                row = next((r for r in summaries[label][section] if r["name"] == name), None)
                cells.append("-" if row is None else f"{row['total_ms']:.1f} ({row['per_step']:.2f})")
            print(f"| {name} | " + " | ".join(cells) + " |")


def print_prefill_steps(summaries: dict[str, dict], limit: int) -> None:
    for label, summary in summaries.items():
        print(f"\n## {label}: the first {limit} prefill steps, in order")
        print("| start ms | prefill requests | prefill tokens | decode requests | host ms | period ms |")
        print("|---|---|---|---|---|---|")
        for s in summary["prefill_steps"][:limit]:
            period = "-" if s["period_ms"] is None else f"{s['period_ms']:.1f}"
            print(f"| {s['start_ms']:.1f} | {s['prefill_requests']} | {s['prefill_tokens']} | "
                  f"{s['decode_requests']} | {s['host_ms']:.1f} | {period} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path, help="trace files or profile directories (one per mode)")
    p.add_argument("--output-json")
    p.add_argument("--list-prefill", type=int, default=0, metavar="N",
                   help="also list each trace's first N prefill steps in order")
    args = p.parse_args(argv)
    summaries = {}
    for path in args.traces:
        trace = find_trace(path)
        summaries[path.name] = {"trace": str(trace), **step_timeline(load_events(trace))}
    print_side_by_side(summaries)
    if args.list_prefill:
        print_prefill_steps(summaries, args.list_prefill)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
