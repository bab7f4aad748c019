"""The serving comparison's pool-use figures, from ``/metrics`` samples."""

from __future__ import annotations

import contextlib
import json

import pytest

from . import load_benchmark

serving = load_benchmark("benchmark_serving")


def test_blocks_per_running_request_averages_busy_samples():
    # 1000 blocks; 10% used by 2 requests (50 each), 30% by 3 (100 each); idle samples ignored.
    samples = [(0.0, 0.0), (0.1, 2.0), (0.3, 3.0), (0.05, 0.0)]
    use = serving.pool_use(samples, 1000)
    assert use["peak_kv_usage"] == 0.3
    assert use["blocks_per_running_request"] == pytest.approx(75.0)


def test_pool_use_without_samples_or_pool_size_is_unknown():
    assert serving.pool_use([], 1000) == {"peak_kv_usage": None, "blocks_per_running_request": None}
    assert serving.pool_use([(0.2, 1.0)], None)["blocks_per_running_request"] is None


def test_num_gpu_blocks_from_cache_config_info_labels():
    values = {'vllm:cache_config_info{block_size="16",num_gpu_blocks="4321"}': 1.0,
              'vllm:num_requests_running{engine="0"}': 3.0}
    assert serving.num_gpu_blocks(values) == 4321
    assert serving.num_gpu_blocks({}) is None


def test_modes_alternate_round_by_round():
    assert serving.schedule(["off", "align", "lighter"], 2) == [
        (0, "off"), (0, "align"), (0, "lighter"), (1, "off"), (1, "align"), (1, "lighter")]


def test_unknown_workload_is_one_clear_error(capsys):
    with pytest.raises(SystemExit):
        serving.parse_args(["--model", "m", "--workloads", "system:8192,chat"])
    assert "unknown workload 'chat'" in capsys.readouterr().err


def test_custom_workload_is_sent_in_order_with_its_own_lengths_and_pacing(tmp_path):
    args = serving.parse_args(["--model", "m", "--workloads", "system:4096,decode"])
    argv = serving.client_args(args, "system:4096", 3, str(tmp_path))
    assert argv[argv.index("--custom-output-len") + 1] == "-1"
    assert "--disable-shuffle" in argv and "--skip-chat-template" in argv
    assert argv[argv.index("--request-rate") + 1] == str(args.system_rate)
    assert argv[argv.index("--num-prompts") + 1] == str(args.system_num_prompts)
    warm = serving.client_args(args, "system:4096", 3, str(tmp_path), warmup=True)
    assert warm[warm.index("--num-prompts") + 1] == str(args.system_num_prompts // 4)
    decode = serving.client_args(args, "decode", 3, str(tmp_path))
    assert "--request-rate" not in decode
    assert decode[decode.index("--max-concurrency") + 1] == str(args.decode_concurrency)


def test_diagnostics_come_from_counter_deltas():
    before = {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 10.0,
              "vllm:iteration_tokens_total_count": 5.0, "vllm:iteration_tokens_total_sum": 50.0,
              "vllm:request_prefill_time_seconds_count": 2.0, "vllm:request_prefill_time_seconds_sum": 1.0,
              'vllm:num_preemptions_total{engine="0"}': 1.0}
    after = {"vllm:prefix_cache_queries_total": 1100.0, "vllm:prefix_cache_hits_total": 510.0,
             "vllm:iteration_tokens_total_count": 45.0, "vllm:iteration_tokens_total_sum": 8050.0,
             "vllm:request_prefill_time_seconds_count": 12.0, "vllm:request_prefill_time_seconds_sum": 3.0,
             'vllm:num_preemptions_total{engine="0"}': 4.0}
    d = serving.run_diagnostics(before, after, completed=10)
    assert d["hit_rate"] == 0.5
    assert d["steps_per_request"] == 4.0 and d["tokens_per_step"] == 200.0
    assert d["mean_prefill_ms"] == pytest.approx(200.0)
    assert d["preemptions"] == 3.0
    assert d["states_cached_per_request"] is None  # not a lighter server
    after['vllm:lighter_mamba_states_cached_total{engine="0"}'] = 30.0
    assert serving.run_diagnostics(before, after, completed=10)["states_cached_per_request"] == 3.0


def vllm_iteration_line(ctx_requests: int, ctx_tokens: int, gen_requests: int, dummy: bool = False) -> str:
    """The line vLLM's own stat logger writes for one engine step (its formatter, not ours)."""
    from types import SimpleNamespace
    from unittest import mock

    from vllm.v1.metrics import loggers
    from vllm.v1.metrics.stats import SchedulerIterationDetails, SchedulerStats

    details = SchedulerIterationDetails(
        iteration_index=7, num_ctx_requests=ctx_requests, num_ctx_tokens=ctx_tokens,
        num_generation_requests=gen_requests, num_generation_tokens=gen_requests, elapsed_ms=12.5,
        is_dummy=dummy)
    fake_logger = SimpleNamespace(_log_prefix_for_engine=lambda index: "", kv_cache_device="GPU")
    with mock.patch.object(loggers, "logger") as logger:
        loggers.LoggingStatLogger._log_iteration_details(
            fake_logger, SchedulerStats(iteration_details=details, kv_cache_usage=0.5), 0)
    (fmt, *values), _ = logger.info.call_args
    return "(APIServer pid=1) INFO 12-07 [loggers.py:199] " + fmt % tuple(values)


def test_prefill_chunks_are_read_from_vllms_own_per_step_lines():
    lines = [vllm_iteration_line(2, 4096, 3), vllm_iteration_line(0, 0, 5),
             vllm_iteration_line(1, 1000, 4), vllm_iteration_line(9, 9999, 0, dummy=True),
             "(APIServer pid=1) INFO 12-07 Engine 000: Avg prompt throughput: 10 tokens/s"]
    # 3 prefill chunks (dummy steps and other lines left out) over 2 requests
    assert serving.prefill_chunks("\n".join(lines), completed=2) == {
        "prefill_steps_per_request": 1.5, "mean_prefill_chunk": pytest.approx(5096 / 3)}
    assert serving.prefill_chunks("no per-step lines", completed=2) == {
        "prefill_steps_per_request": None, "mean_prefill_chunk": None}


def test_a_run_reads_only_the_lines_its_server_wrote_during_the_run(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    log.write_text(vllm_iteration_line(5, 50_000, 0) + "\n")  # the warm-up's steps

    def fake_client(url, argv, in_process=True):
        with log.open("a") as f:
            f.write(vllm_iteration_line(1, 300, 0) + "\n" + vllm_iteration_line(1, 100, 1) + "\n")
        return {"completed": 1}

    monkeypatch.setattr(serving, "metrics", lambda url: {})
    monkeypatch.setattr(serving, "settled_metrics", lambda url: {})
    monkeypatch.setattr(serving, "sampled", lambda url: contextlib.nullcontext([]))
    monkeypatch.setattr(serving, "run_client", fake_client)
    args = serving.parse_args(["--model", "m", "--workloads", "decode"])
    row = serving.run_workload(args, "http://h:0", "decode", 0, str(tmp_path), str(log))
    assert row["prefill_steps_per_request"] == 2.0 and row["mean_prefill_chunk"] == 200.0
    # Without a readable log the run is still measured, its prefill figures unknown.
    row = serving.run_workload(args, "http://h:0", "decode", 0, str(tmp_path), str(tmp_path / "gone.log"))
    assert row["prefill_steps_per_request"] is None and row["mean_prefill_chunk"] is None


def test_summary_has_medians_spreads_and_ratios():
    runs = [{"workload": "rag", "mode": m, "round": r, "p50_ttft_ms": v}
            for m, values in (("off", (100, 120)), ("align", (40, 60)), ("lighter", (30, 50)))
            for r, v in enumerate(values)]
    summary = serving.summarize(runs)
    assert summary["medians"]["rag"]["lighter"]["p50_ttft_ms"] == 40
    assert summary["spreads"]["rag"]["align"]["p50_ttft_ms"] == (40, 60, 2)
    assert summary["ratios"]["rag"]["lighter/align"]["p50_ttft_ms"] == pytest.approx(0.8)
    assert summary["ratios"]["rag"]["align/off"]["p50_ttft_ms"] == pytest.approx(50 / 110)


def test_saved_servers_are_reused_and_none_starts_after_the_budget(tmp_path, monkeypatch):
    started = []
    clock = [0.0]

    def fake_server(args, round_, mode, log_path):
        started.append((round_, mode))
        clock[0] += 100.0  # each server takes 100 s
        return [{"workload": "rag", "mode": mode, "round": round_, "p50_ttft_ms": 1.0}]

    monkeypatch.setattr(serving, "run_server", fake_server)
    monkeypatch.setattr(serving.time, "monotonic", lambda: clock[0])
    base = ["--model", "m", "--modes", "off,lighter", "--rounds", "2", "--results-dir", str(tmp_path)]
    serving.main(base + ["--stop-after-s", "150"])  # starts at 0 s and 100 s; not at 200 s
    assert started == [(0, "off"), (0, "lighter")]
    serving.main(base)  # reuses both, runs the rest
    assert started == [(0, "off"), (0, "lighter"), (1, "off"), (1, "lighter")]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "00-off.json", "01-lighter.json", "02-off.json", "03-lighter.json"]


def test_a_failed_server_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    def fake_server(args, round_, mode, log_path):
        if mode == "lighter":
            raise RuntimeError("vllm serve exited with 1")
        return [{"workload": "rag", "mode": mode, "round": round_, "p50_ttft_ms": 1.0}]

    monkeypatch.setattr(serving, "run_server", fake_server)
    out = tmp_path / "out.json"
    serving.main(["--model", "m", "--modes", "lighter,off", "--rounds", "1", "--results-dir",
                  str(tmp_path), "--output-json", str(out)])
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["failed"]] == ["lighter"]
    assert result["medians"]["rag"]["off"]["p50_ttft_ms"] == 1.0
    assert not (tmp_path / "00-lighter.json").exists()  # a later call retries it


def test_concurrent_servers_start_together_and_runs_alternate_by_workload(tmp_path, monkeypatch):
    launched, calls, logs = [], [], set()

    @contextlib.contextmanager
    def fake_serve_many(specs, ready_timeout):
        launched.append([(s.lighter, s.args) for s in specs])
        yield [f"http://h:{i}" for i in range(len(specs))]

    def fake_workload(args, base_url, workload, seed, tmp, log_path):
        calls.append((base_url, workload, seed))
        logs.add((base_url, log_path))
        return {"workload": workload, "p50_ttft_ms": 1.0}

    monkeypatch.setattr(serving, "serve_many", fake_serve_many)
    monkeypatch.setattr(serving, "run_workload", fake_workload)
    monkeypatch.setattr(serving, "settled_metrics", lambda url: {})  # no server behind the URLs
    monkeypatch.setattr(serving, "run_client",
                        lambda url, argv, in_process=True: calls.append((url, "client", argv)) or {})
    out = tmp_path / "out.json"
    serving.main(["--model", "m", "--modes", "align,lighter", "--rounds", "2", "--concurrent",
                  "--no-probe", "--workloads", "rag,decode", "--results-dir", str(tmp_path),
                  "--output-json", str(out), "--profile-dir", str(tmp_path / "prof"),
                  "--profile-workloads", "rag"])
    assert len(launched) == 1 and [lighter for lighter, _ in launched[0]] == [False, True]
    assert all("--enable-logging-iteration-details" in serve_args for _, serve_args in launched[0])
    # each run reads the per-step lines of its own server's log
    assert logs == {("http://h:0", str(tmp_path / "server-align.log")),
                    ("http://h:1", str(tmp_path / "server-lighter.log"))}
    for _, serve_args in launched[0]:  # each server profiles into its own directory
        config = json.loads(serve_args[serve_args.index("--profiler-config") + 1])
        assert config["torch_profiler_dir"].endswith(("prof/align", "prof/lighter"))
    measured = [(url, w, seed) for url, w, seed in calls if w != "client"]
    # round 0: align then lighter per workload; round 1 rotated: lighter first
    assert measured == [("http://h:0", "rag", 0), ("http://h:1", "rag", 0),
                        ("http://h:0", "decode", 0), ("http://h:1", "decode", 0),
                        ("http://h:1", "rag", 1), ("http://h:0", "rag", 1),
                        ("http://h:1", "decode", 1), ("http://h:0", "decode", 1)]
    profiled = [argv for url, w, argv in calls if w == "client" and "--profile" in argv]
    assert len(profiled) == 2  # one profiled rag run per mode, after the measured ones
    assert calls.index(next(c for c in calls if c[1] == "client" and "--profile" in c[2])) > \
        calls.index(("http://h:0", "decode", 1))
    result = json.loads(out.read_text())
    assert result["spreads"]["rag"]["lighter"]["p50_ttft_ms"] == [1.0, 1.0, 2]
    assert "profile" not in result["medians"]
    assert len(json.loads((tmp_path / "concurrent-runs.json").read_text())) == 10


def test_profiled_workload_must_be_measured_and_needs_a_directory(capsys):
    with pytest.raises(SystemExit):
        serving.parse_args(["--model", "m", "--workloads", "rag", "--profile-dir", "d",
                            "--profile-workloads", "decode"])
    assert "not one of --workloads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving.parse_args(["--model", "m", "--workloads", "rag", "--profile-workloads", "rag"])
    assert "needs --profile-dir" in capsys.readouterr().err


def test_a_lighter_variant_merges_its_settings_into_the_servers_additional_config():
    args = serving.parse_args(["--model", "m", "--modes", "align,lighter:ckpt=none",
                               "--serve-args", "--additional-config '{\"gdn_prefill_backend\": \"triton\"}'"])
    spec = serving.server_spec(args, "lighter:ckpt=none", "log")
    config = json.loads(spec.args[spec.args.index("--additional-config") + 1])
    assert config == {"gdn_prefill_backend": "triton", "lighter_mamba_cold_checkpoints": []}
    assert spec.lighter and spec.args.count("--additional-config") == 1
    plain = serving.server_spec(args, "align", "log")
    plain_config = json.loads(plain.args[plain.args.index("--additional-config") + 1])
    assert plain_config == {"gdn_prefill_backend": "triton"}
    assert serving.mode_label("lighter:ckpt=1/2/4") == "lighter_ckpt_1_2_4"
    ttft = (("align", 40.0), ("lighter", 50.0), ("lighter:ckpt=none", 30.0))
    summary = serving.summarize([{"workload": "rag", "mode": m, "round": 0, "p50_ttft_ms": v}
                                 for m, v in ttft])
    assert summary["ratios"]["rag"]["lighter:ckpt=none/align"]["p50_ttft_ms"] == pytest.approx(0.75)
    assert summary["ratios"]["rag"]["lighter/align"]["p50_ttft_ms"] == pytest.approx(1.25)


def test_a_served_lighter_modes_options_stay_with_it():
    args = serving.parse_args(["--model", "m", "--modes", "off,lighter:cut,ckpt=none,align"])
    assert args.mode_list == ["off", "lighter:cut,ckpt=none", "align"]
    assert serving.mode_serve_args("lighter:cut,ckpt=none")[2] == {
        "lighter_mamba_internal_checkpoints": False, "lighter_mamba_cold_checkpoints": []}


def test_an_unknown_mode_is_one_clear_error(capsys):
    with pytest.raises(SystemExit):
        serving.parse_args(["--model", "m", "--modes", "align,lighter:bogus=1"])
    assert "unknown mode option" in capsys.readouterr().err


def test_a_failed_concurrent_run_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    @contextlib.contextmanager
    def fake_serve_many(specs, ready_timeout):
        yield [f"http://h:{i}" for i in range(len(specs))]

    def fake_workload(args, base_url, workload, seed, tmp, log_path):
        if base_url == "http://h:1":
            raise RuntimeError("vllm bench serve failed")
        return {"workload": workload, "p50_ttft_ms": 1.0}

    monkeypatch.setattr(serving, "serve_many", fake_serve_many)
    monkeypatch.setattr(serving, "run_workload", fake_workload)
    monkeypatch.setattr(serving, "settled_metrics", lambda url: {})  # no server behind the URLs
    monkeypatch.setattr(serving, "run_client", lambda url, argv, in_process=True: {})
    out = tmp_path / "out.json"
    serving.main(["--model", "m", "--modes", "align,lighter", "--rounds", "1", "--concurrent", "--no-probe",
                  "--workloads", "rag,decode", "--results-dir", str(tmp_path), "--output-json", str(out)])
    result = json.loads(out.read_text())
    failed = [(r["mode"], r["failed_workload"]) for r in result["failed"]]
    assert failed == [("lighter", "rag"), ("lighter", "decode")]
    assert result["medians"]["decode"]["align"]["p50_ttft_ms"] == 1.0
