"""Finds the CUDA extension `bem._C`: the one `setup.py` built, else a just-in-time build (cached by
torch under ~/.cache/torch_extensions), else nothing, and then every op runs the PyTorch reference.

Environment: `BEM_JIT=0` skips the just-in-time build; `BEM_DISABLE_KERNELS=1` ignores the extension.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [
    "bindings.cpp", "lowrank_update.cu", "decode_linear.cu", "decode_stream.cu", "lowrank_stream.cu",
    "scale_codes.cu",
]
NVCC_FLAGS = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]
CXX_FLAGS = ["-O3", "-std=c++17"]


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import load

    return load(
        name="bem_C_jit",
        sources=[str(CSRC / name) for name in SOURCES],
        extra_cflags=CXX_FLAGS,
        extra_cuda_cflags=NVCC_FLAGS,
        verbose=os.environ.get("BEM_JIT_VERBOSE") == "1",
    )


def load_extension() -> Optional[ModuleType]:
    """The compiled kernels module, or None (with one warning when a CUDA device goes without them)."""
    if os.environ.get("BEM_DISABLE_KERNELS") == "1":
        return None
    try:
        from bem import _C  # built by setup.py

        return _C
    except (ImportError, OSError) as error:
        prebuilt_error = error
    if not torch.cuda.is_available():
        return None  # CPU-only: the reference is the intended path, nothing to warn about
    if os.environ.get("BEM_JIT", "1") == "0":
        warnings.warn(
            f"BEM CUDA kernels are not built ({prebuilt_error}) and BEM_JIT=0; using the PyTorch reference",
            stacklevel=2,
        )
        return None
    try:
        return _jit_build()
    except Exception as error:  # a missing toolkit or compiler shows up as many exception types
        warnings.warn(
            f"BEM CUDA kernels could not be built ({type(error).__name__}: {error}); using the PyTorch reference",
            stacklevel=2,
        )
        return None
