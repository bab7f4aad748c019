"""Host time of one engine step with N running requests, lighter vs align, no model.

vLLM's real ``Scheduler`` and ``KVCacheManager`` (the simulation harness, one attention and
``--mamba-groups`` Mamba groups) run decode steps for N requests; each step times
``schedule()``, ``update_from_output()`` (and ``update_draft_token_ids()`` with drafting) plus
the worker-side state-index gather of every Mamba group (ours: numba into a preallocated
output; align: vLLM's ``mamba_get_block_table_tensor``), as the CPU builders call it; the mocked
model's sampling and drafting are left out. The two modes alternate
round by round in one process, so the ratio is paired. A benchmark, not a test.

    python benchmarks/benchmark_step_overhead.py [--num-running 64,256] [--rounds 7]
        [--steps 200] [--block-size 256] [--num-spec 2] [--profile lighter]

``--num-spec K``: every step also verifies K draft tokens per request, a seeded random number
of which are the mocked model's next tokens (accepted), as the scheduler replay drafts; the
Mamba groups get K speculative blocks and the gather K more columns. The scheduler is the
synchronous one, which the lighter cache makes hash after an output whose accepted drafts
completed a block (vLLM's async scheduler, its default, hashes after every output in every
mode); ``--hash-after-output`` makes align hash after each output too.

Not included: the runner's per-step copy planning (align's ``preprocess_mamba`` needs a
live model runner) and anything on the device.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import random
import statistics
import time

import torch

from vllm_lighter_mamba.bench.sim import (
    SimRequest,
    accepted_drafts,
    continuation,
    draft_token_ids,
    make_request,
    make_scheduler,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a hybrid model dir (config only); default: the tiny Qwen3-Next")
    p.add_argument("--num-running", default="64,256", help="running requests per step")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds per mode")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per round")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--mamba-groups", type=int, default=1, help="Mamba KV-cache groups (80B: 3)")
    p.add_argument("--num-spec", type=int, default=0, help="draft tokens verified per step")
    p.add_argument("--hash-after-output", action="store_true",
                   help="every mode hashes after each output, as vLLM's async scheduler does")
    p.add_argument("--profile", choices=("align", "lighter"), help="print a cProfile of one round")
    return p.parse_args(argv)


class DecodeLoop:
    """N requests of one mode, admitted and prefilled, then stepped one decode at a time."""

    def __init__(self, mode: str, model: str, n: int, args: argparse.Namespace) -> None:
        from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

        from vllm_lighter_mamba.ops.state_indices import gather_state_indices

        bs = args.block_size
        self.scheduler = make_scheduler(
            mode, model, block_size=bs, num_blocks=n * (args.prompt_len // bs + 8) * (1 + args.mamba_groups),
            max_num_batched_tokens=max(n * args.prompt_len, 8192), max_num_seqs=n,
            max_model_len=8192, num_mamba_groups=args.mamba_groups,
            num_speculative_blocks=args.num_spec, num_spec_tokens=args.num_spec,
            hash_after_output=args.hash_after_output,
        )
        self.num_spec = args.num_spec
        self.draw = functools.partial(random.Random(0).randint, 0)
        self.requests = {}
        for i in range(n):
            sim = SimRequest(f"{mode}-{i}", [(i * 7 + j) % 250 for j in range(args.prompt_len)], 10**6)
            request = make_request(sim, bs)
            self.requests[sim.request_id] = request
            self.scheduler.add_request(request)
        groups = self.scheduler.kv_cache_config.kv_cache_groups[1:]
        self.specs = [g.kv_cache_spec for g in groups]
        max_blocks = 8192 // bs + 1 + args.num_spec
        self.tables = [torch.randint(1, 1000, (n, max_blocks), dtype=torch.int32) for _ in groups]
        self.seq_lens = torch.zeros(n, dtype=torch.int32)
        if mode.startswith("lighter"):
            self.gather = lambda t, s, spec: gather_state_indices(t, s, spec.block_size, args.num_spec)
        else:
            self.gather = lambda t, s, spec: mamba_get_block_table_tensor(t, s, spec, "align")
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.requests.values()):
            self.step()

    def step(self) -> int:
        """One decode step; ns spent in the engine's calls (the mocked model's sampling and
        drafting, the same in every mode, are left out)."""
        from vllm.v1.outputs import ModelRunnerOutput

        start = time.perf_counter_ns()
        output = self.scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        n = len(ids)
        for k, rid in enumerate(ids):
            self.seq_lens[k] = self.requests[rid].num_computed_tokens
        for table, spec in zip(self.tables, self.specs, strict=True):
            self.gather(table[:n], self.seq_lens[:n], spec)
        engine = time.perf_counter_ns() - start
        drafts = output.scheduled_spec_decode_tokens
        sampled = [
            continuation(self.requests[rid].all_token_ids,
                         1 + accepted_drafts(self.requests[rid].all_token_ids, drafts.get(rid, ())))
            for rid in ids
        ]
        runner_output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=sampled)
        start = time.perf_counter_ns()
        self.scheduler.update_from_output(output, runner_output)
        engine += time.perf_counter_ns() - start
        if self.num_spec:
            proposed = draft_token_ids(self.scheduler, output, self.num_spec, self.draw)
            start = time.perf_counter_ns()
            self.scheduler.update_draft_token_ids(proposed)
            engine += time.perf_counter_ns() - start
        return engine

    def timed(self, steps: int) -> float:
        """Engine µs per step over ``steps`` decode steps."""
        return sum(self.step() for _ in range(steps)) / steps / 1000


def paired(times: dict[str, list[float]], mode: str, base: str) -> float:
    """Median over rounds of ``mode``'s time over ``base``'s in the same round."""
    return statistics.median(b / a for a, b in zip(times[base], times[mode], strict=True))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = args.model
    if model is None:
        from pathlib import Path

        from vllm_lighter_mamba.bench.tiny_models import build_tiny_model

        path = Path(".tiny_models/qwen3_next")
        model = str(path if (path / "config.json").exists() else build_tiny_model("qwen3_next", path))
    hashing = ", hashed after each output" if args.hash_after_output else ""
    print(f"block {args.block_size}, prompt {args.prompt_len}, {args.mamba_groups} Mamba group(s), "
          f"{args.num_spec} draft tokens per step{hashing}, "
          f"{args.steps} decode steps x {args.rounds} alternating rounds")
    # lighter:off = the lighter cache without its state retention policy (vLLM's LRU order):
    # what the policy's bookkeeping costs per step.
    modes = ("align", "lighter", "lighter:off")
    print("| running | align µs/step | lighter µs/step | lighter, retention off µs/step | lighter/align "
          "(paired median) | lighter/retention off (paired median) |")
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.num_running.split(",")):
        loops = {mode: DecodeLoop(mode, model, n, args) for mode in modes}
        for loop in loops.values():
            loop.timed(20)  # warm-up (numba, allocations)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode, loop in loops.items():
                times[mode].append(loop.timed(args.steps))
        medians = " | ".join(f"{statistics.median(times[mode]):.0f}" for mode in modes)
        ratios = " | ".join(f"{paired(times, 'lighter', base):.3f}" for base in ("align", "lighter:off"))
        print(f"| {n} | {medians} | {ratios} |")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.runcall(loops[args.profile].timed, args.steps)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
