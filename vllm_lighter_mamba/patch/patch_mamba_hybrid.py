"""vllm.v1.worker.gpu.model_states.mamba_hybrid: Model Runner V2's hybrid-model state runs the
lighter cache's per-step state copy before the forward and, with draft tokens, puts the
accepted states in place after sampling (the same ``MambaStateCopier`` as the V1 runner).
(What / Why / How: ``patch/__init__.py``.)

Model Runner V2 calls ``MambaHybridModelState.preprocess_state`` after the batch's block tables
are gathered and before ``prepare_attn`` builds the metadata (which reads
``num_accepted_tokens_gpu``), and ``postprocess_state`` after sampling. With the lighter cache
``mamba_cache_mode`` is ``"none"``, so upstream's align pre-copy does nothing there; upstream
runs first in all three methods.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.worker.mamba_state_copy import COPIER_ATTR as COPIER
from vllm_lighter_mamba.v1.worker.mamba_state_copy import MambaStateCopier, lighter_groups

SETTLE = "_lighter_mamba_settle_inputs"


class SettleInputs(NamedTuple):
    """What a step's settle needs once sampling is done, taken before the forward (rows in
    that step's batch order; views of Model Runner V2's persistent buffers)."""

    tables: list[torch.Tensor]
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    drafts: torch.Tensor


def spec_decode_drafts(
    num_spec: int,
    is_prefilling: np.ndarray,
    prefill_runs_as_decode: np.ndarray | None,
    num_scheduled: np.ndarray,
    num_draft_tokens_per_req: np.ndarray | None,
) -> np.ndarray:
    """Draft tokens per batch row for the rows the Mamba kernels run as spec-decode rows, -1
    for the others: upstream's ``num_decode_draft_tokens_cpu`` of
    ``MambaHybridModelState.prepare_attn`` (a prompt tail padded with placeholder drafts runs
    as a spec-decode row). Checked against upstream's in ``tests/unit/test_mamba_hybrid_patch.py``."""
    num_reqs = num_scheduled.shape[0]
    if num_draft_tokens_per_req is None:
        num_draft_tokens_per_req = np.zeros(num_reqs, np.int32)
    prefilling = is_prefilling[:num_reqs]
    if prefill_runs_as_decode is not None:
        prefilling = prefilling & ~prefill_runs_as_decode[:num_reqs]
    is_decode = ~prefilling & (num_scheduled > 0) & (num_scheduled <= num_spec + 1)
    return np.where(is_decode, num_draft_tokens_per_req[:num_reqs], -1).astype(np.int32)


def _wrap_initialize_kv_cache(initialize_kv_cache: Any) -> Any:
    @functools.wraps(initialize_kv_cache)
    def initialize_kv_cache_and_copier(self: Any, kv_cache_config: Any, block_tables: Any) -> None:
        initialize_kv_cache(self, kv_cache_config, block_tables)
        copier = None
        if lighter_groups(kv_cache_config):
            forward_context = self.vllm_config.compilation_config.static_forward_context
            copier = MambaStateCopier(forward_context, kv_cache_config, self.device, self.model)
            copier.warm_up([block_tables.input_block_tables[g] for g, _, _ in copier.groups], torch.int32)
        self.__dict__[COPIER] = copier

    return initialize_kv_cache_and_copier


def _wrap_preprocess_state(preprocess_state: Any) -> Any:
    @functools.wraps(preprocess_state)
    def preprocess_state_and_copy(
        self: Any, input_batch: Any, block_tables: Any, kv_cache_config: Any, num_computed_tokens: Any
    ) -> None:
        preprocess_state(self, input_batch, block_tables, kv_cache_config, num_computed_tokens)
        self.__dict__[SETTLE] = None
        copier = self.__dict__.get(COPIER)
        num_reqs = input_batch.num_reqs
        if copier is None or num_reqs == 0:
            return
        if copier.num_spec:
            # prepare_attn hands num_accepted_tokens to the kernels as "read the initial state
            # from column accepted - 1"; the lighter layout keeps the running state in column 0
            # (the settle put it there, the copy moves it along), so every row reads column 0.
            self.num_accepted_tokens_gpu.fill_(1)
        computed = input_batch.num_computed_tokens_np[:num_reqs]
        if not copier.may_move(computed, input_batch.num_scheduled_tokens[:num_reqs]):
            return
        tables = [block_tables[g][:num_reqs] for g, _, _ in copier.groups]
        seq_lens = input_batch.seq_lens[:num_reqs]
        start = input_batch.query_start_loc
        query_lens = start[1 : num_reqs + 1] - start[:num_reqs]
        copier.copy(tables, seq_lens, query_lens)
        if copier.num_spec and input_batch.num_draft_tokens > 0:
            drafts = spec_decode_drafts(
                self.vllm_config.num_speculative_tokens,
                input_batch.is_prefilling_np,
                getattr(input_batch, "prefill_runs_as_decode_np", None),
                input_batch.num_scheduled_tokens[:num_reqs],
                input_batch.num_draft_tokens_per_req,
            )
            drafts_dev = torch.from_numpy(drafts).to(seq_lens.device, non_blocking=True)
            self.__dict__[SETTLE] = SettleInputs(tables, seq_lens, query_lens, drafts_dev)

    return preprocess_state_and_copy


def _wrap_postprocess_state(postprocess_state: Any) -> Any:
    @functools.wraps(postprocess_state)
    def postprocess_state_and_settle(
        self: Any, idx_mapping: Any, num_sampled: Any, num_computed_tokens: Any = None
    ) -> None:
        postprocess_state(self, idx_mapping, num_sampled, num_computed_tokens)
        step: SettleInputs | None = self.__dict__.get(SETTLE)
        self.__dict__[SETTLE] = None
        copier = self.__dict__.get(COPIER)
        # Only the last pipeline stage samples (a tensor); drafting with pipeline parallelism
        # is rejected at start-up (config.py).
        if copier is None or step is None or isinstance(num_sampled, int):
            return
        num_reqs = step.seq_lens.shape[0]
        copier.settle(step.tables, step.seq_lens, step.query_lens, num_sampled[:num_reqs], step.drafts)

    return postprocess_state_and_settle


def apply() -> None:
    try:
        from vllm.v1.worker.gpu.model_states import mamba_hybrid as upstream
    except ImportError:  # a vLLM build without Model Runner V2
        return
    state = upstream.MambaHybridModelState
    for name, wrap in (
        ("initialize_kv_cache", _wrap_initialize_kv_cache),
        ("preprocess_state", _wrap_preprocess_state),
        ("postprocess_state", _wrap_postprocess_state),
    ):
        replace_attr(state, name, wrap(original(state, name)))
