"""The demo: ``VLLM_USE_LIGHTER_MAMBA_CACHE=1 vllm serve`` on a tiny local hybrid model,
requests sharing a long prefix, and the prefix-cache hits they got.

    python scripts/demo.py      (or: make demo)
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from vllm_lighter_mamba.bench.server import cpu_serve_args, metric_total, serve, wait_for_metric
from vllm_lighter_mamba.bench.tiny_models import build_tiny_model

SYSTEM_PROMPT = (
    "You are the ship's computer of the survey vessel Lighter Mamba. Answer crew questions "
    "briefly and precisely, cite the deck and compartment for every location, never guess "
    "a reading you were not given, and log each answer with a timestamp. "
) * 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model dir (default: build the tiny Qwen3-Next)")
    parser.add_argument("--requests", type=int, default=4)
    args = parser.parse_args()
    model = args.model or str(build_tiny_model("qwen3_next", Path(".tiny_models/qwen3_next")))
    from openai import OpenAI

    log_path = os.path.join(tempfile.mkdtemp(prefix="lighter-demo-"), "server.log")
    serve_args = cpu_serve_args() + ["--enable-prompt-tokens-details", "--max-num-batched-tokens", "1024"]
    print(f"starting: VLLM_USE_LIGHTER_MAMBA_CACHE=1 vllm serve {model} {' '.join(serve_args)}")
    print(f"(server log: {log_path}; the CPU engine takes about two minutes to start)")
    # vLLM logs its stats (and the plugin pulls its counters) every VLLM_LOG_STATS_INTERVAL s.
    env = {"VLLM_LOG_STATS_INTERVAL": "2"}
    with serve(model, serve_args, lighter=True, env=env, log_path=log_path) as base_url:
        client = OpenAI(base_url=base_url + "/v1", api_key="unused")
        print(f"prompt: a shared {len(SYSTEM_PROMPT)}-character system prompt + one question each")
        total_cached = 0
        for i in range(args.requests):
            response = client.completions.create(
                model=model,
                prompt=SYSTEM_PROMPT + f"Question {i}: where is the galley?",
                max_tokens=8,
                temperature=0.0,
            )
            usage = response.usage
            details = usage.prompt_tokens_details
            cached = (details.cached_tokens if details else 0) or 0
            total_cached += cached
            print(f"request {i}: prompt_tokens={usage.prompt_tokens} cached_tokens={cached}")
        # The front end pulls the engine's counters when it logs its stats.
        values = wait_for_metric(base_url, "vllm:lighter_mamba_state_hits_total",
                                 at_least=max(args.requests - 1, 1), timeout_s=15.0)
        hits = metric_total(values, "vllm:prefix_cache_hits_total")
        queries = metric_total(values, "vllm:prefix_cache_queries_total")
        print(f"/metrics: vllm:prefix_cache_hits={hits:.0f} vllm:prefix_cache_queries={queries:.0f}")
        lighter = {k: v for k, v in values.items()
                   if k.startswith("vllm:lighter_mamba") and k.endswith("_total")}
        for name, value in sorted(lighter.items()):
            print(f"/metrics: {name}={value:.0f}")
    verdict = "served prefix-cache hits" if total_cached > 0 else "got NO prefix-cache hits"
    print(f"the lighter Mamba cache {verdict}: {total_cached} cached prompt tokens in total")
    if total_cached == 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
