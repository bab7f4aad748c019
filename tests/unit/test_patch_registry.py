"""The patch registry is a contract: every patch module is documented with What/Why/How/
Upstream, and every vLLM module that imports the builders' state-index lookup is patched."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import vllm

from vllm_lighter_mamba import patch
from vllm_lighter_mamba.bench.sim import install_patches
from vllm_lighter_mamba.patch.patch_attention_backends import BUILDER_MODULES, FUNCTION
from vllm_lighter_mamba.v1.attention.backends.utils import lighter_mamba_block_table_tensor


def vllm_modules_importing(name: str) -> set[str]:
    """Modules of the installed vLLM with ``from ... import name`` (the definition excluded)."""
    root = Path(vllm.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        source = path.read_text(errors="ignore")
        if name not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and any(alias.name == name for alias in node.names):
                module = ".".join(("vllm", *path.relative_to(root).with_suffix("").parts))
                found.add(module)
    return found


def test_every_builder_module_that_imports_the_lookup_is_patched():
    importers = vllm_modules_importing(FUNCTION)
    assert importers, "the scan found nothing: vLLM's layout changed"
    assert importers == set(BUILDER_MODULES), importers ^ set(BUILDER_MODULES)
    install_patches()
    for name in BUILDER_MODULES:
        assert getattr(importlib.import_module(name), FUNCTION) is lighter_mamba_block_table_tensor, name


def test_every_patch_module_is_documented_with_what_why_how_upstream():
    # An entry starts at a line that begins with the module's name.
    entries = ("\n" + patch.__doc__).split("\n``patch_")[1:]
    names = {entry.split("``")[0] for entry in entries}
    modules = {module.__name__.rsplit(".patch_", 1)[1] for module in patch.PATCH_MODULES}
    assert names == modules
    for entry in entries:
        for field in ("What:", "Why:", "How:", "Upstream:"):
            assert field in entry, (entry.split("``")[0], field)


def test_every_mamba_builder_that_reuses_metadata_is_switched_off_for_our_spec():
    """``update_block_table`` re-reads state indices from a raw block table in upstream's layout:
    every builder class that overrides it and lives beside the state-index lookup's importers
    (or derives from one of their builders) gets the constructor wrapper."""
    import inspect
    import pkgutil

    import vllm.v1.attention.backends as backends

    from vllm_lighter_mamba.patch.patch_attention_backends import builder_classes

    install_patches()
    wrapped = builder_classes()
    assert all(getattr(cls.__init__, "__lighter_mamba_original__", None) is not None for cls in wrapped)
    missing = []
    for info in pkgutil.iter_modules(backends.__path__):
        name = f"{backends.__name__}.{info.name}"
        try:
            module = importlib.import_module(name)
        except Exception:  # a backend whose kernels this machine lacks (FlashInfer, Triton, ...)
            assert "mamba" not in name and "gdn" not in name and name not in BUILDER_MODULES, name
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or "update_block_table" not in cls.__dict__:
                continue
            mamba_side = module.__name__ in BUILDER_MODULES or any(issubclass(cls, w) for w in wrapped)
            if mamba_side and not any(issubclass(cls, w) for w in wrapped):
                missing.append(cls.__qualname__)
            if "mamba" in module.__name__ or "gdn" in module.__name__:
                assert any(issubclass(cls, w) for w in wrapped), cls.__qualname__
    assert missing == []
