"""Finds the CUDA extension `bem._C`: the one `setup.py` built, else a just-in-time build (cached by
torch under ~/.cache/torch_extensions), else nothing, and then every op runs the PyTorch reference.

Nothing is loaded or compiled at `import bem`: `extension()` looks once, on the first kernel use (or when
a wrapped model is on a CUDA device), and keeps the answer.

Environment: `BEM_JIT=0` skips the just-in-time build; `BEM_DISABLE_KERNELS=1` ignores the extension.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
FAMILIES = ("common", "lowrank", "fftconv", "mlstm", "quant")  # csrc/<family>/, as setup.py lists them


def family_sources(family: str) -> list[str]:
    """The .cpp and .cu files of one kernel family's folder, relative to csrc/, in name order."""
    return [f"{family}/{path.name}" for path in sorted((CSRC / family).iterdir()) if path.suffix in (".cpp", ".cu")]


# csrc/module.cpp (the module's entry) and every family's sources, as setup.py builds them.
SOURCES = ["module.cpp"] + [name for family in FAMILIES for name in family_sources(family)]
NVCC_FLAGS = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]
CXX_FLAGS = ["-O3", "-std=c++17"]


def _jit_arch_list() -> Optional[str]:
    """The architectures of a just-in-time build when TORCH_CUDA_ARCH_LIST is unset: the GPU's own, with
    the arch-specific 9.0a on Hopper (the fused prefill GEMM uses sm_90a instructions)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return None
    major, minor = torch.cuda.get_device_capability()
    return "9.0a" if (major, minor) == (9, 0) else f"{major}.{minor}"


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import load

    arch_list = _jit_arch_list()
    if arch_list is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    print("BEM: compiling the CUDA kernels just in time (first use on this machine; a few minutes, then cached "
          "under ~/.cache/torch_extensions; `pip install --no-build-isolation -e .` builds them ahead)",
          file=sys.stderr, flush=True)
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


NOT_LOOKED = object()  # "not looked for yet", where None would mean "looked for, not there"
_found: object = NOT_LOOKED


def extension() -> Optional[ModuleType]:
    """`load_extension()`, run once per process: the first call may build, later calls are a lookup."""
    global _found
    if _found is NOT_LOOKED:
        _found = load_extension()
    return _found  # type: ignore[return-value]
