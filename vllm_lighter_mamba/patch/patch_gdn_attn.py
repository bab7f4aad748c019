"""vllm.v1.attention.backends.gdn_attn: state indices from our gather kernel."""

from __future__ import annotations

from vllm.v1.attention.backends import gdn_attn as upstream

from vllm_lighter_mamba.patch._util import replace_attr
from vllm_lighter_mamba.v1.attention.backends.utils import lighter_mamba_block_table_tensor


def apply() -> None:
    replace_attr(upstream, "mamba_get_block_table_tensor", lighter_mamba_block_table_tensor)
