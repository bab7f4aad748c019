"""Installing a wrapper once, keeping the upstream object reachable."""

from __future__ import annotations

from typing import Any

ORIGINAL = "__lighter_mamba_original__"


def replace_attr(owner: Any, name: str, replacement: Any) -> None:
    """Set ``owner.name = replacement`` once; the upstream object stays on the wrapper."""
    current = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if getattr(_unwrap(current), ORIGINAL, None) is not None:
        return  # already patched in this process
    setattr(_unwrap(replacement), ORIGINAL, current)
    setattr(owner, name, replacement)


def original(owner: Any, name: str) -> Any:
    """The upstream object that ``replace_attr`` replaced (or the current one)."""
    current = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    return getattr(_unwrap(current), ORIGINAL, current)


def _unwrap(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
