"""The one environment variable that switches the lighter Mamba cache on.

It is read only while vLLM builds its configuration (``register`` and the engine-args patch);
from then on every process asks the configuration (``vllm_lighter_mamba.config.is_active``).
"""

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


def requested_by_environment() -> bool:
    """Whether the user asked for the lighter cache (config time only, never per step)."""
    return parse_flag(os.environ.get(VARIABLE))


def declare_to_vllm() -> None:
    """Add the variable to vLLM's own table of environment variables.

    vLLM warns about (or, with ``--fail-on-environ-validation``, rejects) every ``VLLM_*``
    variable missing from that table. Declaring it is not a behaviour change of vLLM.
    """
    import vllm.envs

    vllm.envs.environment_variables.setdefault(VARIABLE, lambda: os.environ.get(VARIABLE, ""))
