"""vllm.model_executor.models.config: keep Mamba cache mode "none" for our layout."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models import config as upstream

from vllm_lighter_mamba.config import is_active
from vllm_lighter_mamba.patch._util import original, replace_attr


def _verify_and_update_config(cls: Any, vllm_config: Any) -> None:
    if is_active(vllm_config):
        # Upstream would turn "none" into "align" (or "all") and pick a Mamba block size;
        # the lighter layout keeps "none" and sets the block size once it is final
        # (``patch_platform``). Conflicting settings are rejected on the final config.
        return
    upstream_fn = original(upstream.MambaModelConfig, "verify_and_update_config").__func__
    upstream_fn(cls, vllm_config)


def apply() -> None:
    replace_attr(
        upstream.MambaModelConfig, "verify_and_update_config", classmethod(_verify_and_update_config)
    )
