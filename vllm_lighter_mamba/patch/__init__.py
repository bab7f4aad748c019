"""Every place where the lighter cache replaces or wraps an upstream vLLM 0.26 symbol.

One module per upstream module. All are applied by :func:`apply_all_patches`, which
``vllm_lighter_mamba.register`` calls in every vLLM process while
``VLLM_USE_LIGHTER_MAMBA_CACHE`` is on (each process only exercises its own side:
config patches in the front end, scheduler/manager patches in the engine core,
builder/runner patches in the workers).

Config (front end, and wherever vLLM re-verifies the config)
------------------------------------------------------------
``patch_arg_utils`` -> ``vllm.engine.arg_utils.EngineArgs``
``._set_default_chunked_prefill_and_prefix_caching_args``
    What: prefix caching on by default for hybrid models; an explicit
    ``--no-enable-prefix-caching`` is an error.
    Why: vLLM 0.26 keeps prefix caching opt-in for hybrid models; the variable opts in.
    How: wrapped (upstream runs after our default is set).

``patch_model_config`` -> ``vllm.model_executor.models.config.MambaModelConfig.verify_and_update_config``
    What: keep ``mamba_cache_mode="none"`` for hybrid models with prefix caching on,
    set ``mamba_block_size`` to the cache block size, reject conflicting settings.
    Why: upstream turns "none" into "align" (or "all"), which would run its own cache.
    How: replaced while the variable is on; calls ``config.raise_on_conflicts``.

``patch_platform`` -> ``vllm.platforms.interface.Platform._align_hybrid_block_size``
    What: after upstream picks the final block size, make the Mamba block size equal to
    it and check the token budget covers one block.
    Why: upstream does this only for "align"; our layout needs one state per block.
    How: wrapped (upstream runs first).

``patch_kv_cache_interface`` -> ``vllm.v1.kv_cache_interface.MambaSpec.max_num_blocks_per_req``
and ``MambaSpec.max_memory_usage_bytes``
    What: a position-indexed block table row (``cdiv(max_len, block_size) + spec``) and a
    budget of ``2 + spec`` resident state pages per request.
    Why: with "none" upstream sizes both for one state block per request.
    How: wrapped; upstream's result is kept when prefix caching is off.

Engine core
-----------
``patch_scheduler_config`` -> ``vllm.config.scheduler.SchedulerConfig.get_scheduler_cls``
    What: returns vLLM's scheduler class (sync or async, or a user's) with
    ``LighterMambaSchedulerMixin`` in front.
    Why: block-aligned prefill chunks (``v1/core/sched``).
    How: wrapped.

``patch_kv_cache_spec_registry`` -> ``vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry.get_manager_class``
    What: ``LighterMambaManager`` wherever upstream would build ``MambaManager``.
    Why: our state-block allocation, boundary caching and freeing (``v1/core``).
    How: wrapped (vLLM re-registers its built-ins at engine start, so the lookup is
    the stable place to substitute).

``patch_block_pool`` -> ``vllm.v1.core.block_pool.BlockPool._remove_cached_block_hashes``
    What: count evicted hashes of Mamba groups (``vllm:lighter_mamba_states_evicted``).
    Why: evictions happen in the shared pool, outside our manager.
    How: wrapped; upstream's result is returned unchanged.

Front end (serving)
-------------------
``patch_async_llm`` -> ``vllm.v1.engine.async_llm.load_stat_logger_plugin_factories``
    What: adds ``LighterMambaStatLogger`` (Prometheus counters ``vllm:lighter_mamba_*`` and
    a periodic log line) to the stat loggers.
    Why: a ``vllm.stat_logger_plugins`` entry point would switch stats logging on for every
    vLLM user of the environment, variable on or off.
    How: wrapped; only while the variable is on.

Workers
-------
``patch_gdn_attn`` / ``patch_mamba_attn`` / ``patch_linear_attn`` -> the module-level
``mamba_get_block_table_tensor`` name in ``vllm.v1.attention.backends.{gdn_attn,
mamba_attn,linear_attn}`` (``mamba_attn`` serves the Mamba1, Mamba2 and short-conv builders)
    What: state indices from our gather kernel (Triton on GPU, numba on CPU).
    Why: the builders must read and write the block of this step in our layout.
    How: the imported name is rebound to ``lighter_mamba_block_table_tensor``.

``patch_gpu_model_runner`` -> ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs``
    What: after inputs are prepared, copy each moving request's state into its new block.
    Why: a state exists in one block; the next chunk continues from a different block.
    How: wrapped (the CPU runner subclasses the GPU runner and inherits it).
``patch_gpu_model_runner`` -> ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache``
    What: once the KV cache is set up, compile the state-index kernels (numba; Triton on CUDA).
    Why: otherwise the first requests pay for it (~0.3 s per numba signature on CPU).
    How: wrapped; runs only with the lighter layout active (the CPU runner calls super()).
"""

from __future__ import annotations

from vllm_lighter_mamba.patch import (
    patch_arg_utils,
    patch_async_llm,
    patch_block_pool,
    patch_gdn_attn,
    patch_gpu_model_runner,
    patch_kv_cache_interface,
    patch_kv_cache_spec_registry,
    patch_linear_attn,
    patch_mamba_attn,
    patch_model_config,
    patch_platform,
    patch_scheduler_config,
)

PATCH_MODULES = (
    patch_arg_utils,
    patch_model_config,
    patch_platform,
    patch_kv_cache_interface,
    patch_scheduler_config,
    patch_kv_cache_spec_registry,
    patch_block_pool,
    patch_async_llm,
    patch_gdn_attn,
    patch_mamba_attn,
    patch_linear_attn,
    patch_gpu_model_runner,
)


def apply_all_patches() -> None:
    for module in PATCH_MODULES:
        module.apply()
