"""vllm.v1.attention.backends.{gdn_attn, mamba_attn, linear_attn, short_conv_attn}: state indices from our
gather kernel, in every builder module that imports ``mamba_get_block_table_tensor``.

Each of these modules imports the function by name, so the name is rebound in each; a test
scans vLLM's sources for importers and fails on any module missing here.
"""

from __future__ import annotations

import importlib

from vllm_lighter_mamba.patch._util import replace_attr
from vllm_lighter_mamba.v1.attention.backends.utils import lighter_mamba_block_table_tensor

FUNCTION = "mamba_get_block_table_tensor"
# ``mamba_attn`` serves the Mamba1 and Mamba2 builders; short-conv has its own module since
# vLLM 0.32.
BUILDER_MODULES = (
    "vllm.v1.attention.backends.gdn_attn",
    "vllm.v1.attention.backends.mamba_attn",
    "vllm.v1.attention.backends.linear_attn",
    "vllm.v1.attention.backends.short_conv_attn",
)


def apply() -> None:
    for name in BUILDER_MODULES:
        replace_attr(importlib.import_module(name), FUNCTION, lighter_mamba_block_table_tensor)
