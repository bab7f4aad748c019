"""Replays requests through vLLM's real ``Scheduler`` and ``KVCacheManager`` with a mocked
model (no weights, no device): the benchmark's ``--simulate`` mode and the harness of the
core tests.

The KV-cache configuration is hybrid like a real Qwen3-Next or NemotronH: one full-attention
group and one Mamba group sharing a block pool, with equal block sizes. ``mode`` picks the
Mamba cache by building the config a user's flags would build: ``none`` (prefix caching
off), ``align`` (upstream vLLM 0.26), ``lighter`` (ours: the config's lighter-cache decision
and the ``LighterMambaSpec`` the workers would declare). The plugin's patches are installed
in this process once; they are inert for configs without the decision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vllm_lighter_mamba.config import CONFIG_KEY

MODES = ("none", "align", "lighter")


@functools.cache
def install_patches() -> None:
    """What ``register()`` does in a vLLM process with the variable on."""
    from vllm_lighter_mamba.patch import apply_all_patches

    apply_all_patches()


@dataclass
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int = 0
    abort_at_step: int | None = None


@dataclass
class SimResult:
    mode: str
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    peak_blocks: int = 0
    mean_blocks: float = 0.0
    cached_per_request: dict[str, int] = field(default_factory=dict)
    # Tokens the attention groups had cached beyond the Mamba-state hit, recomputed (vLLM's
    # reported shared-prefix junction minus the hit), at each request's first admission.
    lost_per_request: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    chunks: list[tuple[str, int, int, int]] = field(default_factory=list)  # (req, start, n, step)
    max_step_tokens: int = 0
    preemptions: int = 0
    # vLLM's Request objects of the replay, by id (tokens, preemptions, status).
    requests: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@functools.lru_cache(maxsize=64)
def _vllm_config(
    mode: str,
    model_dir: str,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    async_scheduling: bool,
    num_blocks: int,
):
    """Built once per setting: loading the model's HF config dominates a short replay."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    scheduler_config = SchedulerConfig(
        max_num_seqs=min(max_num_seqs, max_num_batched_tokens),
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(model=model_dir, dtype="float32", seed=0, max_model_len=max_model_len)
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=mode != "none",
        mamba_cache_mode="align" if mode == "align" else "none",
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        additional_config={CONFIG_KEY: True} if mode == "lighter" else {},
    )
    # VllmConfig re-verifies hybrid models; pin the settings the replay is about.
    cache_config.num_gpu_blocks = num_blocks
    cache_config.block_size = block_size
    cache_config.mamba_block_size = block_size
    cache_config.enable_prefix_caching = mode != "none"
    cache_config.mamba_cache_mode = "align" if mode == "align" else "none"
    scheduler_config.async_scheduling = async_scheduling
    return vllm_config


def make_scheduler(
    mode: str,
    model_dir: str,
    block_size: int = 16,
    num_blocks: int = 1000,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    num_speculative_blocks: int = 0,
    use_eagle: bool = False,
    async_scheduling: bool = False,
    num_mamba_groups: int = 1,
):
    """A vLLM scheduler over a hybrid KV-cache config (one attention group, then
    ``num_mamba_groups`` Mamba groups, as vLLM groups e.g. Qwen3-Next-80B's 36 GDN layers
    into 3), no model."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    assert mode in MODES, mode
    vllm_config = _vllm_config(
        mode,
        model_dir,
        block_size,
        max_num_batched_tokens,
        max_num_seqs,
        max_model_len,
        async_scheduling,
        num_blocks,
    )
    spec_cls = MambaSpec
    if mode == "lighter":
        from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec

        install_patches()
        spec_cls = LighterMambaSpec
    mamba_spec = spec_cls(
        block_size=block_size,
        shapes=((1,),),
        dtypes=(torch.float32,),
        mamba_cache_mode=vllm_config.cache_config.mamba_cache_mode,
        num_speculative_blocks=num_speculative_blocks,
    )
    attention_spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn"], attention_spec),
            *(KVCacheGroupSpec([f"mamba{i}"], mamba_spec) for i in range(num_mamba_groups)),
        ],
    )
    # The same lookup vLLM's engine core does (patched while the variable is on).
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    assert issubclass(scheduler_cls, AsyncScheduler if async_scheduling else Scheduler)
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )
    if use_eagle:
        scheduler.use_eagle = True
    return scheduler


_hashers: dict[int, object] = {}


def block_hasher(block_size: int):
    """One hasher per block size; the root (none) hash is seeded once per process."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if not _hashers:
        init_none_hash(sha256)
    if block_size not in _hashers:
        _hashers[block_size] = get_request_block_hasher(block_size, sha256)
    return _hashers[block_size]


def make_request(req: SimRequest, block_size: int):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, temperature=0.0)
    return Request(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher(block_size),
    )


def next_token(token_ids: Sequence[int]) -> int:
    """The mocked model: a deterministic function of the whole sequence so far."""
    return (sum(token_ids[-8:]) * 31 + len(token_ids)) % 997


def blocks_in_use(scheduler) -> int:
    pool = scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def replay(
    mode: str,
    requests: Sequence[SimRequest],
    model_dir: str,
    max_steps: int = 100_000,
    check: Callable | None = None,
    observers: Sequence[Callable] = (),
    overlap: bool = False,
    resets: Sequence[int] = (),
    scheduler=None,
    **scheduler_kwargs,
) -> SimResult:
    """Run ``requests`` to completion.

    ``check(scheduler, output, step)`` and each ``observer(output, requests)`` run right
    after every ``schedule()`` (observers see steps in execution order). ``overlap``
    processes step N's output only after step N+1 has been scheduled, as vLLM's async
    scheduling does (use it with ``async_scheduling=True``). At each step in ``resets`` the
    prefix cache is reset with every running request preempted (vLLM's
    ``reset_prefix_cache(reset_running_requests=True)``). Pass the ``scheduler`` of an
    earlier replay to continue on its (warm) prefix cache.
    """
    if scheduler is None:
        scheduler = make_scheduler(mode, model_dir, **scheduler_kwargs)
    block_size = scheduler.cache_config.block_size
    pending = sorted(requests, key=lambda r: r.arrival_step)
    by_id = {r.request_id: r for r in requests}
    result = SimResult(mode=mode)
    live: dict = {}
    step = 0
    total_blocks = 0
    in_flight = None  # (output, scheduled tokens) of the step whose output is not processed
    while pending or in_flight is not None or scheduler.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            sim_req = pending.pop(0)
            request = make_request(sim_req, block_size)
            live[sim_req.request_id] = request
            scheduler.add_request(request)
            result.prompt_tokens += len(sim_req.prompt_token_ids)
        aborts = [
            rid
            for rid, r in by_id.items()
            if r.abort_at_step == step and rid in live and not live[rid].is_finished()
        ]
        if aborts:
            from vllm.v1.request import RequestStatus

            scheduler.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        if step in resets:
            scheduler.reset_prefix_cache(reset_running_requests=True)
        output = scheduler.schedule()
        for rid, n in output.num_scheduled_tokens.items():
            request = live[rid]
            start = request.num_computed_tokens - n
            result.chunks.append((rid, start, n, step))
            if rid not in result.cached_per_request:
                result.cached_per_request[rid] = start  # the prefix-cache hit
                result.lost_per_request[rid] = max(request.shared_prefix_boundary - start, 0)
        result.max_step_tokens = max(result.max_step_tokens, output.total_num_scheduled_tokens)
        if check is not None:
            check(scheduler, output, step)
        for observer in observers:
            observer(output, live)
        # Which requests finish their prompt (or decode) this step, decided as the model
        # runs it: right after scheduling.
        samples = {
            rid: live[rid].num_computed_tokens >= live[rid].num_tokens
            for rid in output.num_scheduled_tokens
        }
        if overlap:
            if in_flight is not None:
                _process(scheduler, *in_flight, live)
            in_flight = (output, samples)
        else:
            _process(scheduler, output, samples, live)
        in_use = blocks_in_use(scheduler)
        result.peak_blocks = max(result.peak_blocks, in_use)
        total_blocks += in_use
        step += 1
        if step > max_steps:
            raise RuntimeError(f"{mode}: requests did not finish in {max_steps} steps")
        if overlap and in_flight is not None and not output.num_scheduled_tokens:
            _process(scheduler, *in_flight, live)  # nothing new to overlap with: drain
            in_flight = None
    for rid, request in live.items():
        result.outputs[rid] = list(request.output_token_ids)
        result.cached_tokens += result.cached_per_request.get(rid, 0)
        result.preemptions += request.num_preemptions
    result.requests = live
    result.steps = step
    result.mean_blocks = total_blocks / max(step, 1)
    result.scheduler = scheduler  # type: ignore[attr-defined]
    return result


def _process(scheduler, output, samples: dict[str, bool], live: dict) -> None:
    """The mocked model's output for one step: a token for every request that samples, a
    deterministic function of its tokens so far (so every mode samples the same)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(samples)
    sampled = [[next_token(live[rid].all_token_ids)] if samples[rid] else [] for rid in req_ids]
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    scheduler.update_from_output(output, runner_output)
