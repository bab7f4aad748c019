"""Run a workload through a real engine (one mode per process) or the simulated scheduler."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from vllm_lighter_mamba.bench.workloads import OpenSource, WaveSource


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    output_token_ids: list[int]
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    wave: int = 0
    # --simulate only: prompt tokens the attention KV could have served but no cached Mamba
    # state did (a shared prefix whose junction state was never computed).
    lost_hit_tokens: int | None = None


@dataclass
class ModeResult:
    mode: str
    workload: str
    requests: list[RequestRecord] = field(default_factory=list)
    wall_s: float | None = None
    peak_blocks: int | None = None
    mean_blocks: float | None = None
    steps: int | None = None
    # --simulate: the pool (blocks), Mamba groups, and the pages held by cached (free,
    # hashed) Mamba states and attention KV, peak and mean over steps, and pages evicted.
    num_blocks: int | None = None
    mamba_groups: int | None = None
    cached_state_peak: int | None = None
    cached_state_mean: float | None = None
    cached_attn_peak: int | None = None
    cached_attn_mean: float | None = None
    evicted_blocks: int | None = None
    preemptions: int | None = None
    # --simulate, lighter: the engine's lighter-cache counters at the end (what /metrics shows).
    counters: dict | None = None
    # --simulate: every step's chunk per request, (request, start, tokens, step), all replays.
    chunks: list[tuple[str, int, int, int]] = field(default_factory=list)

    def summary(self) -> dict:
        prompt = sum(r.prompt_tokens for r in self.requests)
        cached = sum(r.cached_tokens for r in self.requests)
        out = {
            "mode": self.mode,
            "workload": self.workload,
            "num_requests": len(self.requests),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
        }
        if self.wall_s is not None:
            ttfts = sorted(r.ttft_s for r in self.requests if r.ttft_s is not None)
            decode = [r.decode_tok_s for r in self.requests if r.decode_tok_s]
            outputs = sum(len(r.output_token_ids) for r in self.requests)
            out.update(
                wall_s=self.wall_s,
                output_tok_s=outputs / self.wall_s if self.wall_s else None,
                ttft_p50_s=_percentile(ttfts, 50),
                ttft_p99_s=_percentile(ttfts, 99),
                decode_tok_s=statistics.mean(decode) if decode else None,
            )
        if self.peak_blocks is not None:
            out.update(peak_blocks=self.peak_blocks, mean_blocks=self.mean_blocks, steps=self.steps,
                       lost_hit_tokens=sum(r.lost_hit_tokens or 0 for r in self.requests))
        if self.num_blocks is not None:
            out.update(num_blocks=self.num_blocks, mamba_groups=self.mamba_groups,
                       cached_state_peak=self.cached_state_peak, cached_state_mean=self.cached_state_mean,
                       cached_attn_peak=self.cached_attn_peak, cached_attn_mean=self.cached_attn_mean,
                       evicted_blocks=self.evicted_blocks, preemptions=self.preemptions)
        return out

    def to_json(self) -> dict:
        out = {"summary": self.summary(), "requests": [asdict(r) for r in self.requests]}
        if self.counters is not None:
            out["counters"] = self.counters
        return out


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


def run_engine(llm, mode: str, workload: str, source: WaveSource) -> ModeResult:
    """Issue each wave with ``LLM.generate`` after the previous one finished."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    result = ModeResult(mode, workload)
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    wave_index = 0
    progress = tqdm(desc=f"{mode}/{workload}", unit="req")
    while (wave := source(outputs)) is not None:
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in wave]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in wave]
        for request, output in zip(wave, llm.generate(prompts, params, use_tqdm=False), strict=True):
            tokens = list(output.outputs[0].token_ids)
            outputs[request.request_id] = tokens
            metrics = output.metrics
            ttft = decode = None
            if metrics is not None and metrics.first_token_latency:
                ttft = metrics.first_token_latency
                span = metrics.last_token_ts - metrics.first_token_ts
                decode = (len(tokens) - 1) / span if span > 0 and len(tokens) > 1 else None
            result.requests.append(
                RequestRecord(request.request_id, len(request.prompt_token_ids),
                              output.num_cached_tokens or 0, tokens, ttft, decode, wave_index)
            )
        progress.update(len(wave))
        wave_index += 1
    progress.close()
    result.wall_s = time.perf_counter() - start
    return result


def run_simulated(
    mode: str, workload: str, source: WaveSource, model_dir: str, **scheduler_kwargs
) -> ModeResult:
    """The same requests through vLLM's real Scheduler/KVCacheManager with a mocked model.

    Waves run one after the other on the same (warm) prefix cache; an :class:`OpenSource`
    runs as one replay with its arrival steps, each follow-up arriving its think time after
    the request it follows finished.
    """
    from vllm_lighter_mamba.bench.sim import SimRequest, replay

    result = ModeResult(mode, workload, steps=0, peak_blocks=0, mean_blocks=0.0,
                        num_blocks=scheduler_kwargs.get("num_blocks"),
                        mamba_groups=scheduler_kwargs.get("num_mamba_groups", 1),
                        cached_state_peak=0, cached_state_mean=0.0, cached_attn_peak=0,
                        cached_attn_mean=0.0, evicted_blocks=0, preemptions=0)
    weighted = {"mean_blocks": 0.0, "cached_state_mean": 0.0, "cached_attn_mean": 0.0}

    def record(sim, wave: list, waves: dict[str, int]) -> None:
        for r in wave:
            result.requests.append(
                RequestRecord(r.request_id, len(r.prompt_token_ids), sim.cached_per_request[r.request_id],
                              sim.outputs[r.request_id], wave=waves.get(r.request_id, 0),
                              lost_hit_tokens=sim.lost_per_request[r.request_id])
            )
        result.steps += sim.steps
        result.chunks.extend(sim.chunks)
        result.peak_blocks = max(result.peak_blocks, sim.peak_blocks)
        result.cached_state_peak = max(result.cached_state_peak, sim.cached_state_peak)
        result.cached_attn_peak = max(result.cached_attn_peak, sim.cached_attn_peak)
        result.evicted_blocks += sim.evicted_state_blocks + sim.evicted_attn_blocks
        result.preemptions += sim.preemptions
        counters = getattr(sim.scheduler, "lighter_counters", None)
        result.counters = counters.as_dict() if counters is not None else None
        for key in weighted:
            weighted[key] += getattr(sim, key) * sim.steps

    if isinstance(source, OpenSource):
        waves: dict[str, int] = {r.request_id: 0 for r in source.initial}
        issued = list(source.initial)

        def on_finish(request, step: int) -> list:
            request_id = request.request_id
            follow = source.follow_up(request_id, list(request.output_token_ids))
            if follow is None:
                return []
            waves[follow.request_id] = waves[request_id] + 1
            issued.append(follow)
            return [SimRequest(follow.request_id, follow.prompt_token_ids, follow.max_tokens,
                               arrival_step=step + 1 + follow.arrival)]

        sim = replay(
            mode,
            [SimRequest(r.request_id, r.prompt_token_ids, r.max_tokens, arrival_step=r.arrival)
             for r in source.initial],
            model_dir,
            on_finish=on_finish,
            **scheduler_kwargs,
        )
        record(sim, issued, waves)
    else:
        outputs = {}
        wave_index = 0
        scheduler = None
        while (wave := source(outputs)) is not None:
            sim = replay(
                mode,
                [SimRequest(r.request_id, r.prompt_token_ids, r.max_tokens) for r in wave],
                model_dir,
                scheduler=scheduler,
                **scheduler_kwargs,
            )
            scheduler = sim.scheduler  # the next wave runs on the same (warm) prefix cache
            for r in wave:
                outputs[r.request_id] = sim.outputs[r.request_id]
            record(sim, wave, {r.request_id: wave_index for r in wave})
            wave_index += 1
    for key, total in weighted.items():
        setattr(result, key, total / max(result.steps, 1))
    return result
