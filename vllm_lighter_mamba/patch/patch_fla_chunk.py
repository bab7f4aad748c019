"""vllm.third_party.flash_linear_attention.ops.chunk: FLA's per-chunk states (``h``) handed to
the layer whose forward waits for them (internal checkpoints)."""

from __future__ import annotations

import functools
from typing import Any

from vllm.third_party.flash_linear_attention.ops import chunk as upstream

from vllm_lighter_mamba.model_executor.layers.mamba.checkpoint import export_pending
from vllm_lighter_mamba.patch._util import original, replace_attr

NAME = "chunk_gated_delta_rule_fwd_h"


def _wrap(fwd_h: Any) -> Any:
    @functools.wraps(fwd_h)
    def chunk_gated_delta_rule_fwd_h(*args: Any, **kwargs: Any) -> Any:
        h, v_new, final_state = fwd_h(*args, **kwargs)
        export_pending(h)
        return h, v_new, final_state

    return chunk_gated_delta_rule_fwd_h


def apply() -> None:
    replace_attr(upstream, NAME, _wrap(original(upstream, NAME)))
