"""Serving comparison as users measure it: ``vllm serve`` per mode, ``vllm bench serve`` as client.

For each mode (``off``: prefix caching off; ``align``: vLLM's ``--mamba-cache-mode align``;
``lighter``: ``VLLM_USE_LIGHTER_MAMBA_CACHE=1``) one server is started in its own process,
with vLLM's defaults otherwise (async scheduling; torch.compile and CUDA graphs on a GPU).
Each workload then runs ``--repeats`` times against it, repeat ``r`` with seed
``--seed + r`` in every mode (fresh prefixes, so no repeat profits from an earlier one).
The prefix-cache hit rate of each run comes from the server's own ``/metrics``.

    python benchmarks/benchmark_serving.py --model DIR [--modes off,align,lighter] \\
        [--workloads prefix_repetition,random] [--repeats 2] [--results-dir DIR] \\
        [--output-json OUT.json] [--serve-args "--max-model-len 8192 ..."]

With ``--results-dir`` each mode's runs are kept as ``DIR/MODE.json`` and reused, so the
modes can be measured in separate calls (one server start per call on a time-limited host).
The table reports the median over repeats and the ratio to align (and to off).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from vllm_lighter_mamba.bench.server import metric_total, metrics, serve

MODES = ("off", "align", "lighter")
WORKLOADS = ("prefix_repetition", "random")
# (result key, label): what the table shows, per workload.
METRICS = [
    ("p50_ttft_ms", "TTFT p50 ms"), ("p90_ttft_ms", "TTFT p90 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
    ("p50_tpot_ms", "TPOT p50 ms"), ("p90_tpot_ms", "TPOT p90 ms"), ("p99_tpot_ms", "TPOT p99 ms"),
    ("p50_itl_ms", "ITL p50 ms"), ("p90_itl_ms", "ITL p90 ms"), ("p99_itl_ms", "ITL p99 ms"),
    ("output_throughput", "output tok/s"), ("hit_rate", "hit rate"),
    ("draft_acceptance", "drafts accepted / proposed"),
    ("peak_kv_usage", "peak pool use"), ("blocks_per_running_request", "pool blocks / running req"),
]
# Gauges sampled while a workload runs (the pool is shared by attention and state pages).
USAGE, RUNNING = "vllm:kv_cache_usage_perc", "vllm:num_requests_running"
SAMPLE_PERIOD_S = 0.25


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (e.g. a tiny_models build)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of off,align,lighter")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="prefix_repetition and/or random")
    p.add_argument("--repeats", type=int, default=2, help="runs of each workload per server (>1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first repeat")
    p.add_argument("--serve-args", default="", help="extra `vllm serve` arguments, one string")
    p.add_argument("--results-dir", help="keep / reuse each mode's runs here (MODE.json)")
    p.add_argument("--output-json", help="write all runs, medians and ratios here")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the server")
    p.add_argument("--num-warmups", type=int, default=8, help="`vllm bench serve` warm-up requests")
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="skip the greedy correctness probe run before the workloads")
    g = p.add_argument_group("prefix_repetition workload")
    g.add_argument("--prefix-len", type=int, default=2500)
    g.add_argument("--suffix-len", type=int, default=500)
    g.add_argument("--num-prefixes", type=int, default=16)
    g.add_argument("--prefix-output-len", type=int, default=64)
    g.add_argument("--prefix-num-prompts", type=int, default=384)
    g.add_argument("--request-rate", type=float, default=24.0)
    g = p.add_argument_group("random workload (decode-heavy)")
    g.add_argument("--random-input-len", type=int, default=300)
    g.add_argument("--random-output-len", type=int, default=512)
    g.add_argument("--random-num-prompts", type=int, default=256)
    g.add_argument("--max-concurrency", type=int, default=64)
    return p.parse_args(argv)


def mode_serve_args(mode: str) -> tuple[list[str], bool]:
    """(`vllm serve` flags, variable on) of a mode, as a user would switch it."""
    if mode == "off":
        return ["--no-enable-prefix-caching"], False
    if mode == "align":
        return ["--enable-prefix-caching", "--mamba-cache-mode", "align"], False
    if mode == "lighter":
        return [], True
    raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")


def client_args(args: argparse.Namespace, workload: str, seed: int) -> list[str]:
    """`vllm bench serve` arguments of one workload run."""
    common = ["--backend", "vllm", "--model", args.model, "--seed", str(seed), "--ignore-eos",
              "--num-warmups", str(args.num_warmups),
              "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
              "--disable-tqdm"]
    if workload == "prefix_repetition":
        return common + [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.prefix_output_len),
            "--num-prompts", str(args.prefix_num_prompts), "--request-rate", str(args.request_rate),
        ]
    if workload == "random":
        return common + [
            "--dataset-name", "random",
            "--random-input-len", str(args.random_input_len),
            "--random-output-len", str(args.random_output_len),
            "--num-prompts", str(args.random_num_prompts), "--max-concurrency", str(args.max_concurrency),
        ]
    raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")


def run_client(base_url: str, argv: list[str]) -> dict:
    """One `vllm bench serve` run; its saved result JSON."""
    host, port = base_url.removeprefix("http://").split(":")
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *argv,
                   "--host", host, "--port", port, "--save-result", "--result-dir", tmp,
                   "--result-filename", "result.json"]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(Path(tmp, "result.json").read_text())


def probe_prompts() -> list[list[str]]:
    """Waves of greedy requests: a shared prefix and its followers (the first follower too),
    a prompt shorter than a block, two same-step siblings and their followers."""
    def text(seed: int, length: int) -> str:
        return "".join(chr(97 + (i * 7 + seed * 5 + (i // 5)) % 26) for i in range(length))

    prefix = text(1, 3000)
    return [
        [prefix + " " + text(2, 700)],
        [prefix + " one?", prefix + " a second, longer question?", "short"],
        [text(3, 2200) + " x", text(3, 2200) + " y"],
        [text(3, 2200) + " z", prefix + " three?"],
    ]


def run_probe(base_url: str, model: str) -> list[dict]:
    """Greedy completions, wave by wave; outputs and cached tokens per request."""
    import urllib.request

    records = []
    for wave, prompts in enumerate(probe_prompts()):
        for prompt in prompts:
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0})
            request = urllib.request.Request(base_url + "/v1/completions", body.encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                reply = json.loads(response.read())
            details = reply["usage"].get("prompt_tokens_details") or {}
            records.append({"wave": wave, "text": reply["choices"][0]["text"],
                            "cached_tokens": details.get("cached_tokens") or 0})
    return records


@contextlib.contextmanager
def sampled(base_url: str) -> Iterator[list[tuple[float, float]]]:
    """(pool use, running requests) every SAMPLE_PERIOD_S while the block runs. A failed read
    is skipped: sampling must not end a benchmark run."""
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def loop() -> None:
        while not done.wait(SAMPLE_PERIOD_S):
            with contextlib.suppress(OSError, ValueError):
                values = metrics(base_url)
                samples.append((metric_total(values, USAGE), metric_total(values, RUNNING)))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()


def num_gpu_blocks(values: dict[str, float]) -> int | None:
    """The pool's size from vLLM's ``cache_config_info`` labels."""
    for name in values:
        if name.startswith("vllm:cache_config_info{"):
            found = re.search(r'num_gpu_blocks="(\d+)"', name)
            if found:
                return int(found.group(1))
    return None


def pool_use(samples: list[tuple[float, float]], num_blocks: int | None) -> dict:
    """Peak pool use, and the pool blocks held per running request averaged over the samples
    with requests running (attention and state pages together: one pool in a hybrid model)."""
    busy = [(use, running) for use, running in samples if running > 0]
    per_request = (statistics.mean(use * num_blocks / running for use, running in busy)
                   if busy and num_blocks else None)
    return {"peak_kv_usage": max((use for use, _ in samples), default=None),
            "blocks_per_running_request": per_request}


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return metric_total(after, name) - metric_total(before, name)


def run_mode(args: argparse.Namespace, mode: str, log_dir: str) -> list[dict]:
    extra, lighter = mode_serve_args(mode)
    serve_args = extra + ["--enable-prompt-tokens-details"] + shlex.split(args.serve_args)
    runs = []
    log_path = os.path.join(log_dir, f"server-{mode}.log")
    with serve(args.model, serve_args, lighter=lighter, log_path=log_path,
               ready_timeout=args.ready_timeout) as base_url:
        if args.probe:
            runs.append({"mode": mode, "workload": "probe", "requests": run_probe(base_url, args.model)})
            print(json.dumps(runs[-1]), flush=True)
        for repeat in range(args.repeats):
            for workload in args.workloads.split(","):
                before = metrics(base_url)
                with sampled(base_url) as samples:
                    result = run_client(base_url, client_args(args, workload, args.seed + repeat))
                after = metrics(base_url)
                pool_size = num_gpu_blocks(after)
                hits = counter_delta(before, after, "vllm:prefix_cache_hits_total")
                queries = counter_delta(before, after, "vllm:prefix_cache_queries_total")
                drafts = counter_delta(before, after, "vllm:spec_decode_num_draft_tokens_total")
                accepted = counter_delta(before, after, "vllm:spec_decode_num_accepted_tokens_total")
                row = {key: result.get(key) for key, _ in METRICS}
                row.update(mode=mode, workload=workload, repeat=repeat, completed=result.get("completed"),
                           hit_rate=hits / queries if queries else 0.0,
                           draft_acceptance=accepted / drafts if drafts else None,
                           num_gpu_blocks=pool_size, **pool_use(samples, pool_size))
                print(json.dumps(row), flush=True)
                runs.append(row)
    return runs


def probe_agreement(runs: list[dict]) -> dict:
    """Per mode: cached tokens of the probe, and how many outputs equal prefix caching off's."""
    probes = {r["mode"]: r["requests"] for r in runs if r["workload"] == "probe"}
    if "off" not in probes:
        return {}
    reference = [r["text"] for r in probes["off"]]
    return {
        mode: {
            "cached_tokens": [r["cached_tokens"] for r in records],
            "outputs_equal_off": sum(r["text"] == t for r, t in zip(records, reference, strict=True)),
            "hit_outputs_equal_off": sum(
                r["text"] == t for r, t in zip(records, reference, strict=True) if r["cached_tokens"]
            ),
            "requests_with_hits": sum(r["cached_tokens"] > 0 for r in records),
            "requests": len(records),
        }
        for mode, records in probes.items()
    }


def summarize(runs: list[dict]) -> dict:
    """{workload: {mode: {metric: median over repeats}}}, the ratios to align and off, and
    the probe's agreement with prefix caching off."""
    table: dict = {}
    for run in runs:
        if run["workload"] == "probe":
            continue
        cell = table.setdefault(run["workload"], {}).setdefault(run["mode"], {})
        for key, _ in METRICS:
            if run.get(key) is not None:
                cell.setdefault(key, []).append(run[key])
    medians = {w: {m: {k: statistics.median(v) for k, v in cells.items()} for m, cells in modes.items()}
               for w, modes in table.items()}
    ratios: dict = {}
    for workload, modes in medians.items():
        for base in ("align", "off"):
            if "lighter" in modes and base in modes:
                ratios.setdefault(workload, {})[f"lighter/{base}"] = {
                    k: modes["lighter"][k] / modes[base][k]
                    for k in modes["lighter"] if modes[base].get(k)
                }
    return {"medians": medians, "ratios": ratios, "probe": probe_agreement(runs)}


def print_table(summary: dict) -> None:
    for mode, row in summary["probe"].items():
        print(f"probe {mode}: cached {row['cached_tokens']}, outputs equal to off "
              f"{row['outputs_equal_off']}/{row['requests']} (with a hit: "
              f"{row['hit_outputs_equal_off']}/{row['requests_with_hits']})")
    for workload, modes in summary["medians"].items():
        print(f"\n## {workload} (median of repeats)")
        names = [m for m in MODES if m in modes]
        ratio_names = list(summary["ratios"].get(workload, {}))
        print("| metric | " + " | ".join(names + ratio_names) + " |")
        print("|---" * (1 + len(names) + len(ratio_names)) + "|")
        for key, label in METRICS:
            cells = [f"{modes[m][key]:.4g}" if key in modes[m] else "-" for m in names]
            cells += [f"{summary['ratios'][workload][r].get(key, float('nan')):.3f}" for r in ratio_names]
            print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    log_dir = args.results_dir or tempfile.mkdtemp(prefix="lighter-serving-")
    os.makedirs(log_dir, exist_ok=True)
    runs: list[dict] = []
    for mode in args.modes.split(","):
        saved = Path(log_dir, f"{mode}.json") if args.results_dir else None
        if saved is not None and saved.exists():
            runs += json.loads(saved.read_text())
            continue
        mode_runs = run_mode(args, mode, log_dir)
        if saved is not None:
            saved.write_text(json.dumps(mode_runs))
        runs += mode_runs
    summary = summarize(runs)
    print_table(summary)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "runs": runs, **summary}, indent=1))


if __name__ == "__main__":
    main()
