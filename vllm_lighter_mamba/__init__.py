"""vllm-lighter-mamba: block-boundary prefix caching for hybrid Mamba / GDN models in vLLM.

vLLM loads this package through its ``vllm.general_plugins`` entry point and calls
:func:`register` once in every process it starts (front end, engine core, workers).
"""

from __future__ import annotations

from vllm.logger import init_logger

from vllm_lighter_mamba.envs import VARIABLE, lighter_mamba_enabled

__all__ = ["register"]

logger = init_logger("vllm.lighter_mamba")

_registered = False


def register() -> None:
    """Install the patches when the variable is on; a no-op otherwise.

    Idempotent and cheap: vLLM calls it in every process. An invalid value of the
    variable raises here, in the first process vLLM starts, before any engine exists.
    """
    global _registered
    if not lighter_mamba_enabled():
        return
    if _registered:
        return
    from vllm_lighter_mamba.patch import apply_all_patches

    apply_all_patches()
    _registered = True
    logger.debug("%s=1: lighter Mamba cache patches installed in this process", VARIABLE)
