import os

import pytest
import torch


def triton_runs_here() -> bool:
    """Triton runs on a CUDA GPU, or on the CPU under its interpreter."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


requires_triton = pytest.mark.skipif(
    not triton_runs_here(), reason="needs a CUDA GPU or TRITON_INTERPRET=1"
)
def device() -> str:
    """Where the kernels under test run: the GPU if there is one, else the CPU (Triton's
    interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
