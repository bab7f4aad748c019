"""Paired comparisons in one process (not a test): output throughput, or TTFT of prefix hits.

Two engines live in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the lighter cache and a
baseline mode. Their ``generate`` calls alternate A B A B, so both see the same machine load, and
the script reports each round's figure and the per-round ratio. The variable is switched
before each engine's calls: the patches read it at call time.

    python benchmarks/paired_decode.py --model DIR [--baseline align|none] [--rounds 5]
    python benchmarks/paired_decode.py --model DIR --measure ttft [--prefix-len 700]

``--measure throughput`` (default): fresh prompts each round (no hits), output tokens/s.
``--measure ttft``: each round a fresh shared prefix; one cold request computes it, then
``--num-prompts`` followers (prefix + a short unique tail) are sent together; the figure is the
followers' median time to first token (vLLM's ``first_token_latency``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--baseline", choices=("align", "none"), default="align")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--cpu", action="store_true", help="CPU settings (bf16, fp32 states, eager)")
    parser.add_argument("--verbose", action="store_true", help="--measure ttft: per-round hits and TTFTs")
    parser.add_argument("--measure", choices=("throughput", "ttft"), default="throughput")
    parser.add_argument("--prefix-len", type=int, default=700, help="--measure ttft: shared prefix")
    parser.add_argument("--cold-tail", type=int, default=20,
                        help="--measure ttft: unique tokens after the prefix in the cold request")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_LIGHTER_MAMBA_CACHE"] = "1"
    from vllm import LLM, SamplingParams

    from vllm_lighter_mamba.patch import apply_all_patches

    apply_all_patches()
    common = {"model": args.model, "seed": 0, "max_model_len": 4096, "disable_log_stats": False}
    if args.cpu:
        common.update(dtype="bfloat16", mamba_ssm_cache_dtype="float32", enforce_eager=True)
    engines = {}
    os.environ["VLLM_USE_LIGHTER_MAMBA_CACHE"] = "1"
    engines["lighter"] = LLM(**common)
    os.environ["VLLM_USE_LIGHTER_MAMBA_CACHE"] = "0"
    baseline = {"enable_prefix_caching": args.baseline == "align"}
    if args.baseline == "align":
        baseline["mamba_cache_mode"] = "align"
    engines[args.baseline] = LLM(**common, **baseline)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    measure = measure_ttft if args.measure == "ttft" else measure_throughput
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(args.rounds + 1):
        for name, llm in engines.items():
            os.environ["VLLM_USE_LIGHTER_MAMBA_CACHE"] = "1" if name == "lighter" else "0"
            value = measure(llm, args, round_index, params)
            if round_index > 0:  # round 0 warms up (numba, caches)
                rates[name].append(value)
    ratios = [a / b for a, b in zip(rates["lighter"], rates[args.baseline], strict=True)]
    label = "followers' TTFT p50 (s)" if args.measure == "ttft" else "output tok/s"
    for name, values in rates.items():
        print(f"{name}: {label} per round {[round(v, 4) for v in values]}, "
              f"median {statistics.median(values):.4g}")
    print(f"lighter / {args.baseline} per round: {[round(r, 3) for r in ratios]}, "
          f"median {statistics.median(ratios):.3f}")


def tokens(seed: int, n: int) -> list[int]:
    return [(7 * j + 13 * seed + j * j // 11) % 250 + 1 for j in range(n)]


def measure_throughput(llm, args, round_index: int, params) -> float:
    # Fresh prompts each round: no prefix hits, so both modes run the same work.
    prompts = [{"prompt_token_ids": [(7 * i + 13 * round_index + j) % 250 + 1
                                     for j in range(args.prompt_len)]}
               for i in range(args.num_prompts)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def measure_ttft(llm, args, round_index: int, params) -> float:
    from vllm import SamplingParams

    prefix = tokens(1000 + round_index, args.prefix_len)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cold = {"prompt_token_ids": prefix + tokens(2000 + round_index, args.cold_tail)}
    llm.generate([cold], short, use_tqdm=False)
    followers = [{"prompt_token_ids": prefix + tokens(3000 + 50 * round_index + i, 32 + 8 * i)}
                 for i in range(args.num_prompts)]
    outputs = llm.generate(followers, short, use_tqdm=False)
    if args.verbose:
        print(round_index, [o.num_cached_tokens for o in outputs],
              [round(o.metrics.first_token_latency, 4) for o in outputs], flush=True)
    return statistics.median(o.metrics.first_token_latency for o in outputs)


if __name__ == "__main__":
    main()
