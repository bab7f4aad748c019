"""Installing a wrapper once, keeping the upstream object reachable."""

from __future__ import annotations

from typing import Any

ORIGINAL = "__lighter_mamba_original__"
ADDED = "__lighter_mamba_added__"


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


def add_attr(owner: Any, name: str, value: Any) -> None:
    """Give ``owner`` an attribute upstream does not have (once; never overwrite upstream's)."""
    current = getattr(owner, name, None)
    if current is not None and getattr(_unwrap(current), ADDED, False):
        return
    if current is not None:
        raise RuntimeError(f"{owner.__name__}.{name} exists upstream; refusing to overwrite it")
    setattr(_unwrap(value), ADDED, True)
    setattr(owner, name, value)


def _unwrap(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
