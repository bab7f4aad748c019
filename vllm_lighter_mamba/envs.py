"""The one environment variable that switches the lighter Mamba cache on."""

from __future__ import annotations

import os

VARIABLE = "VLLM_USE_LIGHTER_MAMBA_CACHE"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class LighterMambaConfigError(ValueError):
    """A setting the lighter Mamba cache cannot honour (raised before the engine starts)."""


def parse_flag(value: str | None) -> bool:
    """Parse the variable's value: unset or empty is off; anything unknown is an error.

    `bool(os.getenv(...))` would turn "0" into True, which is why this is explicit.
    """
    if value is None or value.strip() == "":
        return False
    normalized = value.strip().lower()
    if normalized in _TRUE:
        return True
    if normalized in _FALSE:
        return False
    accepted = ", ".join(f"{t}/{f}" for t, f in zip(_TRUE, _FALSE, strict=True))
    raise LighterMambaConfigError(
        f"{VARIABLE}={value!r} is not a valid value; accepted (any case): {accepted}, or unset."
    )


def lighter_mamba_enabled() -> bool:
    """Whether the variable is on in this process (every vLLM process inherits it)."""
    return parse_flag(os.environ.get(VARIABLE))
