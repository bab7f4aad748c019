"""With the variable on, a real engine (in-process, so spies see every call) runs our pieces
and none of vLLM's align-only functions."""

from __future__ import annotations

import pytest

from .helpers import CPU_ENGINE, shared_text

pytestmark = pytest.mark.engine


def test_our_pieces_run_and_align_paths_do_not(qwen3_next_dir, monkeypatch):
    from vllm.v1.attention.backends import utils as backend_utils
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.worker import mamba_utils

    from vllm_lighter_mamba.bench.sim import install_patches
    from vllm_lighter_mamba.envs import VARIABLE
    from vllm_lighter_mamba.v1.worker import mamba_state_copy

    from .runner import engine_counters

    calls: dict[str, int] = {}

    def spy(owner, name, record_as):
        upstream = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls[record_as] = calls.get(record_as, 0) + 1
            return upstream(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    align_only = {
        "Scheduler._mamba_block_aligned_split": (Scheduler, "_mamba_block_aligned_split"),
        "MambaManager._cache_partial_tail_block": (MambaManager, "_cache_partial_tail_block"),
        "MambaManager.allocate_new_blocks": (MambaManager, "allocate_new_blocks"),
        "mamba_get_block_table_tensor": (backend_utils, "mamba_get_block_table_tensor"),
        "mamba_utils.preprocess_mamba": (mamba_utils, "preprocess_mamba"),
    }
    for label, (owner, name) in align_only.items():
        spy(owner, name, label)
    # Ours: the state copy, and the numba gather (builders and copy plan on CPU; the states'
    # steps, so spied once the engine is built).
    spy(mamba_state_copy, "copy_states", "ours: copy_states")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv(VARIABLE, "1")
    install_patches()
    from vllm import LLM, SamplingParams

    llm = LLM(model=qwen3_next_dir, dtype="bfloat16", seed=0, max_num_batched_tokens=512, **CPU_ENGINE)
    # Imported only now: numba loads llvmlite, whose module-level ``ffi.lib`` answers every
    # attribute, ``__dict__`` included, with a wrapped C function. vLLM 0.32's worker start-up
    # (CpuPlatform.register_triton_kernel_overrides -> dispatcher._redirect_references) reads
    # ``vars(value).get("kernel")`` for every module attribute in sys.modules and fails on it
    # when llvmlite is already loaded, as it is in this process once numba is imported. The
    # engine loads numba itself later, in initialize_kv_cache's warm-up.
    from vllm_lighter_mamba.ops import state_indices_numba

    spy(state_indices_numba, "state_indices_numba", "ours: state_indices_numba")
    prefix = shared_text(11, 900)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate([prefix + " a"], params, use_tqdm=False)
    second = llm.generate([prefix + " b"], params, use_tqdm=False)
    counters = engine_counters(llm)
    del llm
    assert second[0].num_cached_tokens > 0
    assert counters["state_hits"] == 1 and counters["state_hit_tokens"] == second[0].num_cached_tokens
    for label in align_only:
        assert calls.get(label, 0) == 0, f"{label} ran {calls[label]} times"
    assert calls.get("ours: copy_states", 0) > 0
    # Every step: one gather per GDN builder call plus one copy plan.
    assert calls.get("ours: state_indices_numba", 0) > 10
