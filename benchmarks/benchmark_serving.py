"""Serving comparison as users measure it: ``vllm serve`` per mode, ``vllm bench serve`` as client.

Modes: ``off`` (prefix caching off), ``align`` (vLLM's own prefix caching for hybrids, its
default on vLLM 0.34), ``lighter`` (``VLLM_USE_LIGHTER_MAMBA_CACHE=1``). Each server runs with
vLLM's defaults otherwise (async scheduling; torch.compile and CUDA graphs on a GPU).

Servers are started in rounds, modes alternated (off, align, lighter, off, align, lighter, ...).
Each server first runs a warm-up pass of every workload with the workload's own shapes (another
seed: it leaves no prefix the measured pass could hit; the first minutes of a server include
Triton compilation and autotuning), then the measured pass, with the round's seed in every mode.
Hit rate, preemptions, engine steps and pool use of each run come from the server's ``/metrics``;
prefill steps per request and the mean prefill chunk from vLLM's own per-step log lines
(``--enable-logging-iteration-details``, on for every mode; ``--no-iteration-details`` drops it).

    python benchmarks/benchmark_serving.py --model DIR [--modes off,align,lighter] [--rounds 2] \\
        [--workloads system:16384,multi_turn,rag,decode] [--results-dir DIR] \\
        [--stop-after-s S] [--output-json OUT.json] [--serve-args "--load-format dummy ..."]

Workloads (:mod:`vllm_lighter_mamba.bench.serving_workloads`, sent as custom datasets in
order): ``system:LEN`` (long shared system prompts), ``multi_turn``, ``rag`` (Zipf document
reuse), ``decode`` (decode-heavy); and vLLM's own ``prefix_repetition`` and ``random``.
With ``--results-dir`` each server's runs are kept as ``DIR/NN-MODE.json`` (NN: its place in
the schedule) and reused, so a schedule can be spread over calls of a time-limited host:
``--stop-after-s`` starts no further server once that many seconds have passed.
The table reports, per workload and mode, the median over rounds with the spread (min-max),
and the ratios of the medians to align and to off.

``--concurrent`` starts one server per mode at once on the same GPU (their start-ups overlap, so
three modes cost about one start-up; size each server with ``--serve-args
"--kv-cache-memory-bytes N --gpu-memory-utilization F"``) and keeps them for every round: runs
then alternate modes workload by workload, one server runs at a time, and the spread is the
run-to-run spread of one server per mode (not the server-to-server spread of the default
schedule). ``--profile-dir DIR --profile-workloads W`` adds, after the measured runs, one run
per mode under vLLM's torch profiler (traces in DIR/MODE; ``benchmarks/profile_steps.py``
reads them as a step timeline).
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
import time
from collections.abc import Iterator
from pathlib import Path

from vllm_lighter_mamba.bench import serving_workloads
from vllm_lighter_mamba.bench.server import ServerSpec, metric_total, metrics, serve_many

MODES = ("off", "align", "lighter")
# Workloads of serving_workloads (custom datasets) and vLLM's own datasets.
CUSTOM = ("system", "multi_turn", "rag", "decode")
VLLM_DATASETS = ("prefix_repetition", "random")
DEFAULT_WORKLOADS = "system:16384,multi_turn,rag,decode"
# (result key, label): what the table shows, per workload.
METRICS = [
    ("p50_ttft_ms", "TTFT p50 ms"), ("p90_ttft_ms", "TTFT p90 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
    ("p50_tpot_ms", "TPOT p50 ms"), ("p90_tpot_ms", "TPOT p90 ms"), ("p99_tpot_ms", "TPOT p99 ms"),
    ("p50_itl_ms", "ITL p50 ms"), ("p90_itl_ms", "ITL p90 ms"), ("p99_itl_ms", "ITL p99 ms"),
    ("output_throughput", "output tok/s"), ("hit_rate", "hit rate"),
    ("draft_acceptance", "drafts accepted / proposed"),
    ("steps_per_request", "engine steps / request"), ("tokens_per_step", "tokens / engine step"),
    ("mean_prefill_ms", "prefill time / request ms"),
    ("prefill_steps_per_request", "prefill steps / request"), ("mean_prefill_chunk", "prefill chunk tokens"),
    ("preemptions", "preemptions"),
    ("states_cached_per_request", "states cached / request"),
    ("peak_kv_usage", "peak pool use"), ("blocks_per_running_request", "pool blocks / running req"),
]
# Gauges sampled while a workload runs (the pool is shared by attention and state pages).
USAGE, RUNNING = "vllm:kv_cache_usage_perc", "vllm:num_requests_running"
SAMPLE_PERIOD_S = 0.25
# Counters read before and after each run (vLLM's, and the lighter cache's own).
STEPS = "vllm:iteration_tokens_total"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
PREEMPTIONS = "vllm:num_preemptions_total"
STATES_CACHED = "vllm:lighter_mamba_states_cached_total"
# The lighter cache's counters reach /metrics when vLLM logs its stats (every
# VLLM_LOG_STATS_INTERVAL seconds, 10 by default): every server here logs them every second, and
# a lighter server's counters are read once one more log has passed since its last request.
STATS_INTERVAL_S = 1.0
# vLLM's line per engine step with --enable-logging-iteration-details
# (``LoggingStatLogger._log_iteration_details``): a "context request" is a request scheduled
# before its first output token, i.e. one prefill chunk (a preempted request's recompute counts
# as generation: it has outputs).
ITERATION_LINE = re.compile(
    r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, "
    r"\d+ generation requests, \d+ generation tokens, iteration elapsed time: [\d.]+ ms( \(dummy\))?")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (e.g. a tiny_models build)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated subset of off,align,lighter; lighter:OPTIONS (bench.sim.parse_mode, "
                        "e.g. lighter:ckpt=none) runs the lighter cache with other settings")
    p.add_argument("--rounds", type=int, default=2, help="servers per mode, modes alternated")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                   help="comma-separated: system:LEN, multi_turn, rag, decode, prefix_repetition, random")
    p.add_argument("--seed", type=int, default=0, help="seed of the first round (round r: seed + r)")
    p.add_argument("--warmup-fraction", type=float, default=0.25,
                   help="warm-up pass per server: this share of each workload's requests (0: none)")
    p.add_argument("--serve-args", default="", help="extra `vllm serve` arguments, one string")
    p.add_argument("--results-dir", help="keep / reuse each server's runs here (NN-MODE.json)")
    p.add_argument("--stop-after-s", type=float, help="start no server after this many seconds")
    p.add_argument("--output-json", help="write all runs, medians, spreads and ratios here")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the server")
    p.add_argument("--concurrent", action="store_true",
                   help="one server per mode, all started at once (their start-ups overlap) and kept "
                        "for every round; runs alternate modes workload by workload (size each "
                        "server's memory with --serve-args, e.g. --kv-cache-memory-bytes)")
    p.add_argument("--profile-dir", help="start each server with vLLM's torch profiler writing to "
                   "DIR/MODE (off until a profiled run); the profiled runs follow the measured ones")
    p.add_argument("--profile-workloads", default="",
                   help="comma-separated workloads of one profiled run per mode (needs --profile-dir)")
    p.add_argument("--profile-max-iterations", type=int, default=400,
                   help="engine steps a profiled run records at most")
    p.add_argument("--client", choices=("in-process", "subprocess"), default="in-process",
                   help="vLLM's benchmark called in this process (its start-up paid once), or the "
                        "`vllm bench serve` command per run")
    p.add_argument("--no-iteration-details", dest="iteration_details", action="store_false",
                   help="start the servers without vLLM's per-step log line (no prefill steps per "
                        "request or prefill chunk length in the table)")
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="skip the greedy correctness probe of each first-round server")
    g = p.add_argument_group("system:LEN workload (long shared system prompts)")
    g.add_argument("--system-num-prompts", type=int, default=24)
    g.add_argument("--system-num-prefixes", type=int, default=4)
    g.add_argument("--system-rate", type=float, default=1.0)
    g = p.add_argument_group("multi_turn workload")
    g.add_argument("--chats", type=int, default=12)
    g.add_argument("--turns", type=int, default=5)
    g.add_argument("--first-turn-len", type=int, default=2048)
    g.add_argument("--chat-rate", type=float, default=3.0)
    g = p.add_argument_group("rag workload (Zipf document reuse)")
    g.add_argument("--rag-num-prompts", type=int, default=40)
    g.add_argument("--rag-docs", type=int, default=32)
    g.add_argument("--rag-doc-len", type=int, default=4096)
    g.add_argument("--rag-zipf", type=float, default=1.1)
    g.add_argument("--rag-rate", type=float, default=2.0)
    g = p.add_argument_group("custom workloads' answers")
    g.add_argument("--output-len", type=int, default=128, help="answer length (system, multi_turn, rag)")
    g = p.add_argument_group("decode workload (decode-heavy)")
    g.add_argument("--decode-num-prompts", type=int, default=48)
    g.add_argument("--decode-input-len", type=int, default=512)
    g.add_argument("--decode-output-len", type=int, default=512)
    g.add_argument("--decode-concurrency", type=int, default=24)
    g = p.add_argument_group("vLLM's prefix_repetition dataset")
    g.add_argument("--prefix-len", type=int, default=2500)
    g.add_argument("--suffix-len", type=int, default=500)
    g.add_argument("--num-prefixes", type=int, default=16)
    g.add_argument("--prefix-output-len", type=int, default=64)
    g.add_argument("--prefix-num-prompts", type=int, default=384)
    g.add_argument("--request-rate", type=float, default=24.0)
    g = p.add_argument_group("vLLM's random dataset")
    g.add_argument("--random-input-len", type=int, default=300)
    g.add_argument("--random-output-len", type=int, default=512)
    g.add_argument("--random-num-prompts", type=int, default=256)
    g.add_argument("--max-concurrency", type=int, default=64)
    args = p.parse_args(argv)
    for name in args.workloads.split(","):
        if name.split(":")[0] not in CUSTOM + VLLM_DATASETS:
            known = ", ".join(CUSTOM[1:] + VLLM_DATASETS)
            p.error(f"unknown workload {name!r}; expected system:LEN or one of {known}")
    for name in filter(None, args.profile_workloads.split(",")):
        if name not in args.workloads.split(","):
            p.error(f"profiled workload {name!r} is not one of --workloads")
    if args.profile_workloads and not args.profile_dir:
        p.error("--profile-workloads needs --profile-dir")
    from vllm_lighter_mamba.bench.sim import split_modes

    # A lighter mode's options stay together (``lighter:cut,ckpt=none``); ``off`` starts a mode
    # here (caching off), so a served list cannot carry the retention option ``off``.
    args.mode_list = split_modes(args.modes, MODES)
    for mode in args.mode_list:
        try:
            mode_serve_args(mode)
        except ValueError as error:
            p.error(str(error))
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def schedule(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) of each server, modes alternated round by round."""
    return [(r, mode) for r in range(rounds) for mode in modes]


def concurrent_order(modes: list[str], round_: int) -> list[str]:
    """The modes of one round of the concurrent schedule, rotated round by round so that no
    mode always runs first after another mode's run."""
    shift = round_ % len(modes)
    return modes[shift:] + modes[:shift]


def mode_serve_args(mode: str) -> tuple[list[str], bool, dict]:
    """(`vllm serve` flags, variable on, ``additional_config`` entries) of a mode, as a user
    would switch it. ``lighter:OPTIONS`` is the lighter cache with the settings of
    ``bench.sim.parse_mode`` (e.g. ``lighter:ckpt=none``: no cold-prompt checkpoints)."""
    if mode == "off":
        return ["--no-enable-prefix-caching"], False, {}
    if mode == "align":
        return ["--enable-prefix-caching"], False, {}
    if mode.partition(":")[0] == "lighter":
        from vllm_lighter_mamba.bench.sim import lighter_options_config, parse_mode

        return [], True, lighter_options_config(parse_mode(mode)[1])
    raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)} or lighter:OPTIONS")


def mode_label(mode: str) -> str:
    """A mode as a file name (``lighter:ckpt=1/2/4`` -> ``lighter_ckpt_1_2_4``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", mode)


def with_additional_config(serve_args: list[str], entries: dict) -> list[str]:
    """``serve_args`` with ``entries`` merged into its ``--additional-config`` JSON (or added)."""
    if not entries:
        return serve_args
    out = list(serve_args)
    for i, arg in enumerate(out):
        if arg == "--additional-config" and i + 1 < len(out):
            out[i + 1] = json.dumps({**json.loads(out[i + 1]), **entries})
            return out
        if arg.startswith("--additional-config="):
            out[i] = "--additional-config=" + json.dumps({**json.loads(arg.partition("=")[2]), **entries})
            return out
    return out + ["--additional-config", json.dumps(entries)]


def custom_workload(args: argparse.Namespace, name: str, seed: int) -> serving_workloads.Workload:
    """A custom-dataset workload of the command line, for one seed."""
    kind, _, length = name.partition(":")
    w = serving_workloads
    if kind == "system":
        return w.system_prompt(seed, int(length), args.system_num_prompts, args.system_num_prefixes,
                               output_len=args.output_len, request_rate=args.system_rate)
    if kind == "multi_turn":
        return w.multi_turn(seed, args.chats, args.turns, args.first_turn_len, output_len=args.output_len,
                            request_rate=args.chat_rate)
    if kind == "rag":
        return w.rag(seed, args.rag_num_prompts, args.rag_docs, args.rag_doc_len, args.rag_zipf,
                     output_len=args.output_len, request_rate=args.rag_rate)
    if kind == "decode":
        return w.decode(seed, args.decode_num_prompts, args.decode_input_len, args.decode_output_len,
                        args.decode_concurrency)
    raise ValueError(f"unknown workload {name!r}")


COMMON = ["--backend", "vllm", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl",
          "--metric-percentiles", "50,90,99", "--disable-tqdm"]


def custom_client_args(workload: serving_workloads.Workload, dataset_path: str) -> list[str]:
    """`vllm bench serve` arguments that send a custom workload's requests in order."""
    argv = ["--dataset-name", "custom", "--dataset-path", dataset_path, "--custom-output-len", "-1",
            "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(len(workload.requests))]
    if workload.request_rate is not None:
        argv += ["--request-rate", str(workload.request_rate)]
    if workload.max_concurrency is not None:
        argv += ["--max-concurrency", str(workload.max_concurrency)]
    return argv


def vllm_dataset_client_args(args: argparse.Namespace, workload: str, warmup: bool) -> list[str]:
    """`vllm bench serve` arguments of vLLM's own datasets (a warm-up sends its share)."""
    def count(num_prompts: int) -> str:
        return str(serving_workloads.warm_up_count(num_prompts, args.warmup_fraction) if warmup
                   else num_prompts)

    if workload == "prefix_repetition":
        return ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-output-len", str(args.prefix_output_len),
                "--num-prompts", count(args.prefix_num_prompts),
                "--request-rate", str(args.request_rate)]
    return ["--dataset-name", "random", "--random-input-len", str(args.random_input_len),
            "--random-output-len", str(args.random_output_len),
            "--num-prompts", count(args.random_num_prompts),
            "--max-concurrency", str(args.max_concurrency)]


def client_args(
    args: argparse.Namespace, workload: str, seed: int, tmp: str, warmup: bool = False
) -> list[str]:
    """`vllm bench serve` arguments of one run of a workload (its dataset written under tmp)."""
    common = COMMON + ["--model", args.model, "--seed", str(seed)]
    if workload in VLLM_DATASETS:
        return common + vllm_dataset_client_args(args, workload, warmup)
    custom = custom_workload(args, workload, seed)
    if warmup:
        custom = serving_workloads.warm_up_of(custom, args.warmup_fraction)
    path = custom.write(Path(tmp, f"{custom.name}-{seed}.jsonl"))
    return common + custom_client_args(custom, str(path))


def run_client(base_url: str, argv: list[str], in_process: bool = True) -> dict:
    """One `vllm bench serve` run; its saved result JSON. ``in_process``: vLLM's benchmark
    (``vllm.benchmarks.serve.main``, what the CLI calls) with the same arguments, in this
    process: the CLI's own start-up (importing vLLM, ~20 s on the GPU host) is paid once,
    not per run. Otherwise the `vllm bench serve` command, as a user types it."""
    host, port = base_url.removeprefix("http://").split(":")
    with tempfile.TemporaryDirectory() as tmp:
        full = [*argv, "--host", host, "--port", port, "--save-result", "--result-dir", tmp,
                "--result-filename", "result.json"]
        if in_process:
            from vllm.benchmarks.serve import add_cli_args
            from vllm.benchmarks.serve import main as bench_main
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            parser = FlexibleArgumentParser()
            add_cli_args(parser)
            try:
                bench_main(parser.parse_args(full))
            except (Exception, SystemExit) as error:  # one failed run, reported as the CLI's would be
                raise RuntimeError(f"vllm bench serve failed: {error!r}") from error
        else:
            command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *full]
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


def cache_config_label(values: dict[str, float], label: str) -> int | None:
    """An integer label of vLLM's ``cache_config_info`` (``num_gpu_blocks``, ``block_size``)."""
    for name in values:
        if name.startswith("vllm:cache_config_info{"):
            found = re.search(label + r'="(\d+)"', name)
            if found:
                return int(found.group(1))
    return None


def num_gpu_blocks(values: dict[str, float]) -> int | None:
    """The pool's size from vLLM's ``cache_config_info`` labels."""
    return cache_config_label(values, "num_gpu_blocks")


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


def run_diagnostics(before: dict[str, float], after: dict[str, float], completed: int) -> dict:
    """What the server did for one run, from its counters: hit rate, engine steps per request,
    tokens per step, mean prefill time, preemptions, states cached per request (lighter only:
    vLLM has no such counter for align)."""
    def delta(name: str) -> float:
        return counter_delta(before, after, name)

    queries, steps = delta("vllm:prefix_cache_queries_total"), delta(STEPS + "_count")
    drafts, prefills = delta("vllm:spec_decode_num_draft_tokens_total"), delta(PREFILL_TIME + "_count")
    per_request = completed or None
    return {
        "hit_rate": delta("vllm:prefix_cache_hits_total") / queries if queries else 0.0,
        "draft_acceptance": delta("vllm:spec_decode_num_accepted_tokens_total") / drafts if drafts else None,
        "steps_per_request": steps / per_request if per_request else None,
        "tokens_per_step": delta(STEPS + "_sum") / steps if steps else None,
        "mean_prefill_ms": 1000 * delta(PREFILL_TIME + "_sum") / prefills if prefills else None,
        "preemptions": delta(PREEMPTIONS),
        "states_cached_per_request": (delta(STATES_CACHED) / per_request
                                      if per_request and STATES_CACHED in _names(after) else None),
    }


def log_size(log_path: str | None) -> int:
    """Where a server's log ends now (0 if there is none yet)."""
    try:
        return os.path.getsize(log_path) if log_path else 0
    except OSError:
        return 0


def prefill_chunks(log_text: str, completed: int) -> dict:
    """Prefill steps per completed request and mean prefill chunk length (tokens), from the
    per-step lines vLLM wrote for one run (dummy steps left out); unknown without such lines."""
    chunks = tokens = 0
    for found in ITERATION_LINE.finditer(log_text):
        if found.group(3) is None:
            chunks += int(found.group(1))
            tokens += int(found.group(2))
    if not chunks:
        return {"prefill_steps_per_request": None, "mean_prefill_chunk": None}
    return {"prefill_steps_per_request": chunks / completed if completed else None,
            "mean_prefill_chunk": tokens / chunks}


def read_log_since(log_path: str | None, offset: int) -> str:
    """What a server's log gained since ``offset`` ("" without a readable log: these figures
    are diagnostics, and a log that cannot be read must not turn a measured run into a failed
    one, as an OSError from ``run_workload`` does in the concurrent schedule)."""
    try:
        with open(log_path or "", "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def _names(values: dict[str, float]) -> set[str]:
    return {name.partition("{")[0] for name in values}


def run_workload(args: argparse.Namespace, base_url: str, workload: str, seed: int, tmp: str,
                 log_path: str | None = None) -> dict:
    """One measured run of a workload against a running server, with its diagnostics
    (``log_path``: the server's log, for its per-step lines of this run)."""
    before = metrics(base_url)  # settled: the warm-up or the previous run ended with settled_metrics
    log_offset = log_size(log_path)
    with sampled(base_url) as samples:
        result = run_client(base_url, client_args(args, workload, seed, tmp), args.client == "in-process")
    after = settled_metrics(base_url)
    pool_size = num_gpu_blocks(after)
    completed = result.get("completed") or 0
    row = {key: result.get(key) for key, _ in METRICS}
    row.update(run_diagnostics(before, after, completed))
    row.update(prefill_chunks(read_log_since(log_path, log_offset), completed))
    row.update(workload=workload, completed=result.get("completed"), num_gpu_blocks=pool_size,
               block_size=cache_config_label(after, "block_size"),
               total_input_tokens=result.get("total_input_tokens"), duration_s=result.get("duration"),
               **pool_use(samples, pool_size))
    return row


def settled_metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` once a lighter server's own counters include its last request: they arrive
    with vLLM's next stats log (every STATS_INTERVAL_S here); vLLM's counters need no wait."""
    values = metrics(base_url)
    if STATES_CACHED in _names(values):
        time.sleep(STATS_INTERVAL_S + 1.0)
        values = metrics(base_url)
    return values


def profiler_serve_args(profile_dir: str, mode: str, max_iterations: int) -> list[str]:
    """`vllm serve` flags of vLLM's torch profiler, writing to PROFILE_DIR/MODE. It records
    nothing until a client starts it (`vllm bench serve --profile`)."""
    config = {"profiler": "torch", "torch_profiler_dir": str(Path(profile_dir, mode_label(mode)).resolve()),
              "torch_profiler_with_stack": False, "ignore_frontend": True,
              "max_iterations": max_iterations}
    return ["--profiler-config", json.dumps(config)]


def server_spec(args: argparse.Namespace, mode: str, log_path: str) -> ServerSpec:
    """The `vllm serve` of one mode."""
    extra, lighter, config = mode_serve_args(mode)
    serve_args = extra + ["--enable-prompt-tokens-details"] + shlex.split(args.serve_args)
    if args.iteration_details:
        serve_args.append("--enable-logging-iteration-details")
    serve_args = with_additional_config(serve_args, config)
    if args.profile_dir:
        serve_args += profiler_serve_args(args.profile_dir, mode, args.profile_max_iterations)
    env = {"VLLM_LOG_STATS_INTERVAL": str(STATS_INTERVAL_S)}
    return ServerSpec(args.model, serve_args, lighter, env=env, log_path=log_path)


def warm_up(args: argparse.Namespace, base_url: str, seed: int, tmp: str) -> float:
    """A warm-up pass of every workload with another seed; its seconds. Ends once the
    server's counters have settled, so that the next run reads them from there."""
    started = time.monotonic()
    if args.warmup_fraction > 0:
        for workload in args.workloads.split(","):
            run_client(base_url, client_args(args, workload, seed + 10_000, tmp, warmup=True),
                       args.client == "in-process")
    seconds = time.monotonic() - started
    settled_metrics(base_url)  # the first measured run's "before" includes the warm-up (and probe)
    return seconds


def run_server(args: argparse.Namespace, round_: int, mode: str, log_path: str) -> list[dict]:
    """One server of the schedule: (first round) the probe, a warm-up pass of every workload
    with another seed, then every workload's measured run with the round's seed."""
    workloads = args.workloads.split(",")
    seed = args.seed + round_
    runs = []
    started = time.monotonic()
    with serve_many([server_spec(args, mode, log_path)], args.ready_timeout) as (base_url,), \
            tempfile.TemporaryDirectory() as tmp:
        ready_s = time.monotonic() - started
        if args.probe and round_ == 0:
            runs.append({"mode": mode, "round": round_, "workload": "probe",
                         "requests": run_probe(base_url, args.model)})
            print(json.dumps(runs[-1]), flush=True)
        warmup_s = warm_up(args, base_url, seed, tmp)
        for workload in workloads:
            row = run_workload(args, base_url, workload, seed, tmp, log_path)
            row.update(mode=mode, round=round_, server_ready_s=ready_s, warmup_s=warmup_s)
            print(json.dumps(row), flush=True)
            runs.append(row)
    return runs


def run_concurrent(args: argparse.Namespace, log_dir: str, started: float) -> list[dict]:
    """The concurrent schedule: one server per mode, all started at once; the probe and a
    warm-up pass per server; then per round every workload, its modes alternated
    (:func:`concurrent_order`); then one profiled run per mode of each --profile-workloads.
    Runs are written to LOG_DIR/concurrent-runs.json as they finish (a killed call keeps them);
    --stop-after-s starts no further round."""
    modes = args.mode_list
    specs = [server_spec(args, mode, str(Path(log_dir, f"server-{mode_label(mode)}.log")))
             for mode in modes]
    for spec, mode in zip(specs, modes, strict=True):
        # Servers compiling at once must not share torch.compile's cache directory.
        spec.env["VLLM_CACHE_ROOT"] = str(Path(log_dir, f"vllm-cache-{mode_label(mode)}").resolve())
    saved = Path(log_dir, "concurrent-runs.json")
    runs: list[dict] = []

    def keep(row: dict) -> None:
        runs.append(row)
        print(json.dumps(row), flush=True)
        saved.write_text(json.dumps(runs))

    with serve_many(specs, args.ready_timeout) as urls, tempfile.TemporaryDirectory() as tmp:
        ready_s = time.monotonic() - started
        url = dict(zip(modes, urls, strict=True))
        log_path = {mode: spec.log_path for mode, spec in zip(modes, specs, strict=True)}
        if args.probe:
            for mode in modes:
                keep({"mode": mode, "round": 0, "workload": "probe",
                      "requests": run_probe(url[mode], args.model)})
        warmup_s = {mode: warm_up(args, url[mode], args.seed, tmp) for mode in modes}
        for round_ in range(args.rounds):
            if args.stop_after_s is not None and time.monotonic() - started > args.stop_after_s:
                print(f"stop: {time.monotonic() - started:.0f} s passed; round {round_} and later "
                      "not run", flush=True)
                break
            for workload in args.workloads.split(","):
                for mode in concurrent_order(modes, round_):
                    try:
                        row = run_workload(args, url[mode], workload, args.seed + round_, tmp,
                                           log_path[mode])
                    except (RuntimeError, OSError) as error:  # one failed run: the next one runs
                        keep({"mode": mode, "round": round_, "workload": "failed",
                              "failed_workload": workload, "error": str(error)[-4000:]})
                        with contextlib.suppress(OSError):  # its counts stay out of the next run
                            settled_metrics(url[mode])
                        continue
                    row.update(mode=mode, round=round_, server_ready_s=ready_s,
                               warmup_s=warmup_s[mode], concurrent=True)
                    keep(row)
        for workload in filter(None, args.profile_workloads.split(",")):
            for mode in modes:
                argv = client_args(args, workload, args.seed + 20_000, tmp) + ["--profile"]
                result = run_client(url[mode], argv, args.client == "in-process")
                keep({"mode": mode, "workload": "profile", "profiled": workload,
                      **{key: result.get(key) for key in ("p50_ttft_ms", "p50_tpot_ms", "completed")}})
    return runs


def run_sequential(args: argparse.Namespace, log_dir: str, started: float) -> list[dict]:
    """The default schedule: a server per (round, mode), modes alternated; each server's runs
    kept in LOG_DIR/NN-MODE.json and reused by a later call (with --results-dir)."""
    runs: list[dict] = []
    for index, (round_, mode) in enumerate(schedule(args.mode_list, args.rounds)):
        saved = Path(log_dir, f"{index:02d}-{mode_label(mode)}.json")
        if args.results_dir and saved.exists():
            runs += json.loads(saved.read_text())
            continue
        if args.stop_after_s is not None and time.monotonic() - started > args.stop_after_s:
            print(f"stop: {time.monotonic() - started:.0f} s passed; server {index} ({mode}) "
                  f"and later not started", flush=True)
            break
        log_path = str(Path(log_dir, f"server-{index:02d}-{mode_label(mode)}.log"))
        try:
            server_runs = run_server(args, round_, mode, log_path)
        except (RuntimeError, TimeoutError, OSError) as error:  # a failed server: the next one runs
            print(f"server {index} ({mode}) failed: {error}"[:4000], flush=True)
            runs.append({"mode": mode, "round": round_, "workload": "failed", "error": str(error)[-4000:]})
            continue
        if args.results_dir:
            saved.write_text(json.dumps(server_runs))
        runs += server_runs
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
    """{workload: {mode: {metric: median over rounds}}}, the spread (min, max) of each,
    the ratios of the medians to align and off, and the probe's agreement with caching off."""
    table: dict = {}
    for run in runs:
        if run["workload"] in ("probe", "failed", "profile"):
            continue
        cell = table.setdefault(run["workload"], {}).setdefault(run["mode"], {})
        for key, _ in METRICS:
            if run.get(key) is not None:
                cell.setdefault(key, []).append(run[key])
    medians = {w: {m: {k: statistics.median(v) for k, v in cells.items()} for m, cells in modes.items()}
               for w, modes in table.items()}
    spreads = {w: {m: {k: (min(v), max(v), len(v)) for k, v in cells.items()} for m, cells in modes.items()}
               for w, modes in table.items()}
    ratios: dict = {}
    for workload, modes in medians.items():
        for base in ("align", "off"):
            for mode in (m for m in modes if m.partition(":")[0] == "lighter" and base in modes):
                ratios.setdefault(workload, {})[f"{mode}/{base}"] = {
                    k: modes[mode][k] / modes[base][k] for k in modes[mode] if modes[base].get(k)
                }
        if "align" in modes and "off" in modes:
            ratios.setdefault(workload, {})["align/off"] = {
                k: modes["align"][k] / modes["off"][k] for k in modes["align"] if modes["off"].get(k)
            }
    return {"medians": medians, "spreads": spreads, "ratios": ratios, "probe": probe_agreement(runs)}


def print_table(summary: dict) -> None:
    for mode, row in summary["probe"].items():
        print(f"probe {mode}: cached {row['cached_tokens']}, outputs equal to off "
              f"{row['outputs_equal_off']}/{row['requests']} (with a hit: "
              f"{row['hit_outputs_equal_off']}/{row['requests_with_hits']})")
    for workload, modes in summary["medians"].items():
        print(f"\n## {workload} (median of rounds, min-max, runs)")
        names = [m for m in MODES if m in modes] + [m for m in modes if m not in MODES]
        ratio_names = list(summary["ratios"].get(workload, {}))
        print("| metric | " + " | ".join(names + ratio_names) + " |")
        print("|---" * (1 + len(names) + len(ratio_names)) + "|")
        for key, label in METRICS:
            cells = []
            for m in names:
                if key not in modes[m]:
                    cells.append("-")
                    continue
                low, high, count = summary["spreads"][workload][m][key]
                cells.append(f"{modes[m][key]:.4g} ({low:.4g}-{high:.4g}, {count})")
            cells += [f"{summary['ratios'][workload][r].get(key, float('nan')):.3f}" for r in ratio_names]
            print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    log_dir = args.results_dir or tempfile.mkdtemp(prefix="lighter-serving-")
    os.makedirs(log_dir, exist_ok=True)
    if args.concurrent:
        try:
            runs = run_concurrent(args, log_dir, started)
        except (RuntimeError, TimeoutError, OSError) as error:  # what finished is on disk
            print(f"concurrent servers failed: {error}"[:4000], flush=True)
            saved = Path(log_dir, "concurrent-runs.json")
            runs = json.loads(saved.read_text()) if saved.exists() else []
            runs.append({"mode": args.modes, "workload": "failed", "error": str(error)[-4000:]})
    else:
        runs = run_sequential(args, log_dir, started)
    summary = summarize(runs)
    summary["failed"] = [r for r in runs if r["workload"] == "failed"]
    print_table(summary)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "runs": runs, **summary}, indent=1))


if __name__ == "__main__":
    main()
