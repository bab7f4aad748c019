"""Token-level workloads for the prefix-caching benchmark (engine and ``--simulate``).

A workload is a list of waves; each wave is a list of requests issued together after the
previous wave finished. Prompts are token ids (no tokenizer involved), so the engine and the
simulation see exactly the same requests. ``multi-turn`` prompts extend the previous turn's
prompt and output, so its waves are built one at a time from the outputs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

WORKLOADS = ("repeat", "shared-prefix", "divergent", "multi-turn", "few-shot")


@dataclass
class WorkloadSpec:
    num_prompts: int = 16
    repeat_count: int = 2
    prefix_len: int = 1024
    input_length_range: tuple[int, int] = (64, 256)
    output_len: int = 16
    seed: int = 0
    vocab: int = 250
    num_turns: int = 3


@dataclass
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


Wave = list[BenchRequest]
# Given the outputs so far ({request_id: token ids}), the next wave, or None when done.
WaveSource = Callable[[dict[str, list[int]]], Wave | None]


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _length(rng: random.Random, spec: WorkloadSpec) -> int:
    low, high = spec.input_length_range
    return rng.randint(low, high)


def workload_rng(name: str, spec: WorkloadSpec) -> random.Random:
    """Each workload draws its own tokens: with one shared seed, workloads run one after the
    other in the same engine would share their prefix and start warm."""
    return random.Random(f"{name}:{spec.seed}")


def static_waves(name: str, spec: WorkloadSpec) -> list[Wave]:
    rng = workload_rng(name, spec)
    n, out = spec.num_prompts, spec.output_len
    if name == "repeat":
        prompts = [_tokens(rng, spec.prefix_len + _length(rng, spec), spec.vocab) for _ in range(n)]
        return [
            [BenchRequest(f"r{k}-{i}", p, out) for i, p in enumerate(prompts)]
            for k in range(spec.repeat_count)
        ]
    if name in ("shared-prefix", "few-shot", "divergent"):
        prefix_len = spec.prefix_len
        if name == "divergent":
            # Ends mid-block for any power-of-two block size up to 64 (upstream vLLM #45238).
            prefix_len += 37
        prefix = _tokens(rng, prefix_len, spec.vocab)

        def suffix_len() -> int:
            if name == "few-shot":
                return max(4, _length(rng, spec) // 8)
            if name == "divergent":
                return _length(rng, spec) * 4
            return _length(rng, spec)

        prompts = [prefix + _tokens(rng, suffix_len(), spec.vocab) for _ in range(n)]
        # The first request computes the prefix; the rest follow together.
        waves = [[BenchRequest("p0", prompts[0], out)], [
            BenchRequest(f"p{i}", p, out) for i, p in enumerate(prompts[1:], start=1)
        ]]
        for k in range(1, spec.repeat_count):
            waves.append([BenchRequest(f"p{i}-again{k}", p, out) for i, p in enumerate(prompts)])
        return waves
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


def from_list(waves: list[Wave]) -> WaveSource:
    remaining = iter(waves)
    return lambda outputs: next(remaining, None)


def wave_source(name: str, spec: WorkloadSpec) -> WaveSource:
    """Waves for any workload; multi-turn builds each turn from the previous outputs."""
    if name != "multi-turn":
        return from_list(static_waves(name, spec))
    rng = workload_rng(name, spec)
    conversations = [
        _tokens(rng, spec.prefix_len // 4 + _length(rng, spec), spec.vocab) for _ in range(spec.num_prompts)
    ]
    turn = 0

    def next_wave(outputs: dict[str, list[int]]) -> Wave | None:
        nonlocal turn
        if turn >= spec.num_turns:
            return None
        if turn > 0:
            for c, prompt in enumerate(conversations):
                reply = outputs[f"c{c}-t{turn - 1}"]
                conversations[c] = prompt + reply + _tokens(rng, _length(rng, spec) // 2, spec.vocab)
        wave = [BenchRequest(f"c{c}-t{turn}", list(p), spec.output_len) for c, p in enumerate(conversations)]
        turn += 1
        return wave

    return next_wave


def trace_waves(path: str) -> list[Wave]:
    """Replay a user's log: JSONL lines with ``arrival`` (a step or wave number; lines with
    the same arrival form one wave), ``prompt_token_ids`` and ``output_len``."""
    by_arrival: dict[float, Wave] = {}
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            item = json.loads(line)
            request = BenchRequest(
                str(item.get("request_id", f"t{i}")), list(item["prompt_token_ids"]), int(item["output_len"])
            )
            by_arrival.setdefault(float(item.get("arrival", i)), []).append(request)
    return [by_arrival[k] for k in sorted(by_arrival)]


def random_trace(rng: random.Random, one_at_a_time: bool = False, max_model_len: int = 8192):
    """A random scheduler trace for ``bench.sim.replay``: (requests, scheduler kwargs, replay kwargs).

    Shared prefixes (small vocabularies make prompts collide often), arrivals, aborts, small
    pools (waiting and preemption), ``reset_prefix_cache`` with running requests, sync and
    async scheduling with real overlap, block sizes from 16 to 1056 (as vLLM picks for
    hybrid models). ``one_at_a_time``: one running request and a pool nothing is evicted from.
    """
    from vllm_lighter_mamba.bench.sim import SimRequest

    block_size = rng.choice([16, 32, 64, 256, 544, 1056])
    max_blocks = min(6, (max_model_len - 128) // block_size - 1)
    vocab = rng.choice([3, 300])

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prefixes = [tokens(rng.randrange(0, max_blocks * block_size)) for _ in range(rng.randrange(1, 4))]
    requests = []
    for i in range(rng.randrange(1, 8)):
        prompt = (rng.choice(prefixes) + tokens(rng.randrange(1, 3 * block_size)))[: max_model_len - 80]
        abort = rng.randrange(0, 40) if rng.random() < 0.15 and not one_at_a_time else None
        requests.append(SimRequest(f"q{i}", prompt, rng.randrange(1, 40), rng.randrange(0, 30), abort))
    budget = block_size * rng.randrange(1, 6) + rng.randrange(0, block_size)
    async_scheduling = rng.random() < 0.5
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    # Small pools: one long request fits (the engine checks that at start-up), several wait
    # or get preempted.
    min_blocks = 2 * (longest // block_size + 4) + 8
    scheduler_kwargs = {
        "block_size": block_size,
        "max_num_batched_tokens": budget,
        "max_num_seqs": 1 if one_at_a_time else rng.choice([1, 2, 4, 8]),
        "num_blocks": 1000 if one_at_a_time else rng.choice([min_blocks, 2 * min_blocks, 400]),
        "max_model_len": max_model_len,
        "async_scheduling": async_scheduling,
    }
    resets = []
    if rng.random() < 0.2 and not one_at_a_time:
        resets = sorted(rng.sample(range(1, 60), rng.randrange(1, 3)))
    return requests, scheduler_kwargs, {"overlap": async_scheduling, "resets": resets}
