"""Model Runner V2's settle rows: our restatement of upstream's spec-decode rows
(``patch_mamba_hybrid.spec_decode_drafts``) against ``MambaHybridModelState.prepare_attn``'s own
``num_decode_draft_tokens_cpu``, on random batches."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_lighter_mamba.patch.patch_mamba_hybrid import spec_decode_drafts

mamba_hybrid = pytest.importorskip("vllm.v1.worker.gpu.model_states.mamba_hybrid")


def upstream_drafts(monkeypatch, num_spec, batch) -> np.ndarray:
    """``num_decode_draft_tokens_cpu`` as upstream's prepare_attn hands it to the builders."""
    captured = {}

    def capture(**kwargs):
        captured.update(kwargs)
        return {}

    monkeypatch.setattr(mamba_hybrid, "build_attn_metadata", capture)
    state = mamba_hybrid.MambaHybridModelState.__new__(mamba_hybrid.MambaHybridModelState)
    model_config = SimpleNamespace(max_model_len=4096)
    state.vllm_config = SimpleNamespace(num_speculative_tokens=num_spec, model_config=model_config)
    state.model_config = model_config
    state.num_accepted_tokens_gpu = torch.ones(64, dtype=torch.int32)
    state._align_mode = False
    state.recoverssm = None
    state._use_flashinfer_replayssm = False  # (vLLM 0.34)
    state.prepare_attn(batch, mamba_hybrid.CUDAGraphMode.NONE, (), torch.empty(0), [], None)
    return captured["model_specific_attn_metadata"].num_decode_draft_tokens_cpu.numpy()


@pytest.mark.parametrize("seed", range(20))
def test_settle_rows_are_upstreams_spec_decode_rows(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    num_spec = int(rng.integers(1, 5))
    n = int(rng.integers(1, 12))
    is_prefilling = rng.random(n) < 0.4
    runs_as_decode = (is_prefilling & (rng.random(n) < 0.5)) if rng.random() < 0.5 else None
    drafts = rng.integers(0, num_spec + 1, n).astype(np.int32)
    # Around the limit of a spec-decode row (num_spec + 1 tokens), for prefills too.
    scheduled = rng.integers(0, num_spec + 4, n).astype(np.int32)
    per_req = drafts if rng.random() < 0.8 else None
    start = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    batch = SimpleNamespace(
        num_reqs=n, num_reqs_after_padding=n,
        num_tokens=int(start[-1]), num_tokens_after_padding=int(start[-1]),
        query_start_loc_np=start, query_start_loc=torch.from_numpy(start), max_query_len=int(scheduled.max()),
        seq_lens_cpu_upper_bound=torch.from_numpy(scheduled + 10), seq_lens=torch.from_numpy(scheduled + 10),
        is_prefilling_np=is_prefilling, prefill_runs_as_decode_np=runs_as_decode,
        idx_mapping=torch.arange(n), num_draft_tokens_per_req=per_req, num_scheduled_tokens=scheduled,
        dcp_local_seq_lens=None, positions=torch.empty(0), prompt_lens=None,
    )
    expected = upstream_drafts(monkeypatch, num_spec, batch)
    ours = spec_decode_drafts(num_spec, is_prefilling, runs_as_decode, scheduled, per_req)
    assert ours.tolist() == expected.tolist()
