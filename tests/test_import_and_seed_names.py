"""`import bem` compiles and loads nothing; the seed's documented names import."""

from __future__ import annotations

import subprocess
import sys


def test_import_bem_looks_up_no_extension():
    code = ("import bem, bem.kernels, bem.kernels.loader as loader, bem.kernels.custom_ops as ops; "
            "assert loader._found is loader.NOT_LOOKED and ops._C is loader.NOT_LOOKED; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_seed_names_import():
    from bem.hierarchical_bem import HierarchicalBEMConfig, create_hierarchical_bem
    from bem.kernels import CUDA_AVAILABLE, KERNELS_AVAILABLE, fused_generated_update
    from bem.kernels.cuda_ops import fused_generated_update as from_cuda_ops

    import bem

    assert HierarchicalBEMConfig is bem.HierarchicalBEMConfig
    assert create_hierarchical_bem is bem.create_hierarchical_bem
    assert fused_generated_update is from_cuda_ops
    assert CUDA_AVAILABLE is KERNELS_AVAILABLE and isinstance(CUDA_AVAILABLE, bool)
