"""vllm.v1.attention.backends.{gdn_attn, mamba_attn, linear_attn, short_conv_attn}: state indices from our
gather kernel, in every builder module that imports ``mamba_get_block_table_tensor``.

Each of these modules imports the function by name, so the name is rebound in each; a test
scans vLLM's sources for importers and fails on any module missing here.

The same modules' builders may reuse one KV-cache group's metadata for the next group with
``update_block_table``, which re-reads state indices from that group's raw block table in
upstream's layout (the running block in column 0); for our spec every group builds its own
metadata, so every group's indices come from the gather.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from vllm_lighter_mamba.patch._util import original, replace_attr
from vllm_lighter_mamba.v1.attention.backends.utils import lighter_mamba_block_table_tensor
from vllm_lighter_mamba.v1.kv_cache_interface import LighterMambaSpec

FUNCTION = "mamba_get_block_table_tensor"
# ``mamba_attn`` serves the Mamba1 and Mamba2 builders; short-conv has its own module since
# vLLM 0.32.
BUILDER_MODULES = (
    "vllm.v1.attention.backends.gdn_attn",
    "vllm.v1.attention.backends.mamba_attn",
    "vllm.v1.attention.backends.linear_attn",
    "vllm.v1.attention.backends.short_conv_attn",
)


def builder_classes() -> list[type]:
    """The metadata builder classes of ``BUILDER_MODULES`` that have a constructor of their own."""
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    found = []
    for name in BUILDER_MODULES:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (cls.__module__ == name and issubclass(cls, AttentionMetadataBuilder)
                    and "__init__" in cls.__dict__):
                found.append(cls)
    return found


def _wrap_builder_init(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if isinstance(getattr(self, "kv_cache_spec", None), LighterMambaSpec):
            self.supports_update_block_table = False

    return __init__


def apply() -> None:
    for name in BUILDER_MODULES:
        replace_attr(importlib.import_module(name), FUNCTION, lighter_mamba_block_table_tensor)
    for cls in builder_classes():
        replace_attr(cls, "__init__", _wrap_builder_init(original(cls, "__init__")))
