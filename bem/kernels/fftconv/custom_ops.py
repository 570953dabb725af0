"""The fftconv kernels as `torch.library` custom ops, with fake (meta) implementations for torch.compile and
the autograd formula. Registered whether or not the extension loaded; only running them needs it.

    bem::fftconv_spectrum(k, L)                           -> S, complex64 (H, M + 1)
    bem::fftconv(u, k, D, pregate, postgate, gelu, S)     -> (y, S'): y of u's shape and dtype, S' the spectrum
                                                             it computed (S None, M <= 16384) or empty
    bem::fftconv_bwd(dy, u, k, D, pregate, postgate, gelu, S, needs) -> (du, dk, dD, dpregate, dpostgate)
    bem::fftconv_step(history!, u_t, k, position, position_value, D, pregate, postgate, gelu) -> y_t

M = max(1024, next power of two >= L); S = rfft(k[:, :L], n = 2M), the filter's spectrum: passing the S of
an earlier call with the same k and spectrum length skips its computation (the dispatch caches it at
inference), None computes it. Backward, with v = pregate ⊙ u, c = conv(v, k) + D ⊙ v,
g = dy ⊙ postgate ⊙ act'(c):
    dpostgate = dy ⊙ act(c),  dv = corr(g, k) + D ⊙ g (anti-causal),  du = dv ⊙ pregate,  dpregate = dv ⊙ u,
    dk[j] = sum_{b,t} g_t v_{t-j},  dD = sum_{b,t} g_t v_t.
A gradient that is not needed comes back as an empty tensor (the op's schema has no optional outputs).

The extension is `bem._C` (`bem.kernels.custom_ops.extension()`). With BEM_FFTCONV_DEV_MODULE=1 it is
instead a module of this family's sources alone, built just in time (scripts/gpu/fftconv.sh): the other
families' sources need not compile for these kernels to be built and tested. BEM_FFTCONV_DEV_OBJECTS names a
folder of the CUDA sources' objects compiled ahead (`scripts/gpu/fftconv.sh objects`): then only the bindings
are compiled.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from .. import custom_ops as _family_ops
from .. import loader

_NOT_LOOKED = object()
_found: object = _NOT_LOOKED


def _dev_module() -> Optional[ModuleType]:
    from torch.utils.cpp_extension import load

    root = Path(__file__).resolve().parents[3]
    sources = [str(loader.CSRC / name) for name in loader.family_sources("fftconv")]
    bindings = [source for source in sources if source.endswith(".cpp")]
    bindings.append(str(root / "scripts" / "fftconv_dev_module.cpp"))
    verbose = os.environ.get("BEM_JIT_VERBOSE") == "1"
    objects = os.environ.get("BEM_FFTCONV_DEV_OBJECTS")
    if objects:
        prebuilt = sorted(str(p) for p in Path(objects).glob("fftconv*.o"))
        return load(name="bem_fftconv_dev_objects", sources=bindings, extra_cflags=loader.CXX_FLAGS,
                    extra_ldflags=prebuilt, with_cuda=True, verbose=verbose)
    # BEM_FFTCONV_DEV_NVCC_FLAGS: extra nvcc flags (a kernel variant's -D switches), built under a name of
    # their own so that variants do not rebuild each other
    extra = os.environ.get("BEM_FFTCONV_DEV_NVCC_FLAGS", "").split()
    name = "bem_fftconv_dev" + "".join("_" + "".join(c for c in flag if c.isalnum()) for flag in extra)
    kernels = [source for source in sources if source.endswith(".cu")]
    return load(name=name, sources=kernels + bindings, extra_cflags=loader.CXX_FLAGS,
                extra_cuda_cflags=loader.NVCC_FLAGS + extra, verbose=verbose)


def extension() -> Optional[ModuleType]:
    """The module with the fftconv kernels, or None (looked up once, on first use)."""
    global _found
    if _found is _NOT_LOOKED:
        if os.environ.get("BEM_FFTCONV_DEV_MODULE") == "1" and torch.cuda.is_available():
            _found = _dev_module()
        else:
            found = _family_ops.extension()
            _found = found if hasattr(found, "fftconv_forward") else None
    return _found  # type: ignore[return-value]


def _ext() -> ModuleType:
    found = extension()
    if found is None:
        raise RuntimeError("the fftconv CUDA kernels are not loaded; bem.kernels.fftconv routes such calls to "
                           "the reference")
    return found


MAX_KEPT_SPECTRUM = 16384  # the largest M whose computed spectrum the forward returns for the backward


def spectrum_length(L: int) -> int:
    """M: the spectrum has M + 1 bins (a real FFT of size 2M); the kernels pad short sequences to 1024."""
    return max(1024, 1 << max(0, (L - 1).bit_length()))


@torch.library.custom_op("bem::fftconv_spectrum", mutates_args=())
def fftconv_spectrum(k: Tensor, L: int) -> Tensor:
    return _ext().fftconv_spectrum(k, L)


@fftconv_spectrum.register_fake
def _(k, L):
    return k.new_empty(k.shape[0], spectrum_length(L) + 1, dtype=torch.complex64)


@torch.library.custom_op("bem::fftconv", mutates_args=())
def fftconv_op(u: Tensor, k: Tensor, D: Optional[Tensor], pregate: Optional[Tensor], postgate: Optional[Tensor],
               gelu: bool, spectrum: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return tuple(_ext().fftconv_forward(u, k, D, pregate, postgate, gelu, spectrum))


@fftconv_op.register_fake
def _(u, k, D, pregate, postgate, gelu, spectrum):
    M = spectrum_length(u.shape[-1])
    kept = spectrum is None and M <= MAX_KEPT_SPECTRUM
    return torch.empty_like(u), k.new_empty((k.shape[0], M + 1) if kept else (0,), dtype=torch.complex64)


def fftconv(u: Tensor, k: Tensor, D: Optional[Tensor], pregate: Optional[Tensor], postgate: Optional[Tensor],
            gelu: bool, spectrum: Optional[Tensor]) -> Tensor:
    """y of `bem::fftconv` (whose second output is the spectrum it computed, kept for the backward)."""
    return fftconv_op(u, k, D, pregate, postgate, gelu, spectrum)[0]


@torch.library.custom_op("bem::fftconv_bwd", mutates_args=())
def fftconv_bwd(grad_y: Tensor, u: Tensor, k: Tensor, D: Optional[Tensor], pregate: Optional[Tensor],
                postgate: Optional[Tensor], gelu: bool, spectrum: Optional[Tensor],
                needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(_ext().fftconv_backward(grad_y, u, k, D, pregate, postgate, gelu, spectrum, needs))


@fftconv_bwd.register_fake
def _(grad_y, u, k, D, pregate, postgate, gelu, spectrum, needs):
    like = (u, k, D, pregate, postgate)
    return tuple(t.new_empty(t.shape) if need and t is not None else u.new_empty(0) for t, need in zip(like, needs))


@torch.library.custom_op("bem::fftconv_step", mutates_args=("history",))
def fftconv_step(history: Tensor, u_t: Tensor, k: Tensor, position: Optional[Tensor], position_value: int,
                 D: Optional[Tensor], pregate: Optional[Tensor], postgate: Optional[Tensor], gelu: bool) -> Tensor:
    return _ext().fftconv_step(history, u_t, k, position, position_value, D, pregate, postgate, gelu)


@fftconv_step.register_fake
def _(history, u_t, k, position, position_value, D, pregate, postgate, gelu):
    return torch.empty_like(u_t)


def _setup(ctx, inputs, output) -> None:
    u, k, D, pregate, postgate, gelu, spectrum = inputs
    computed = output[1]
    ctx.mark_non_differentiable(computed)
    # no zero gradient for that spectrum (a complex (H, M + 1) fill a step); an unused y comes as None
    ctx.set_materialize_grads(False)
    # the backward reuses the filter's spectrum: the one given, or the one this forward computed (kept up to
    # MAX_KEPT_SPECTRUM; above, the backward computes it again rather than hold it between the passes)
    ctx.save_for_backward(u, k, D, pregate, postgate, spectrum if spectrum is not None or computed.numel() == 0
                          else computed)
    ctx.gelu = gelu


def _backward(ctx, grad_y, _grad_spectrum):
    u, k, D, pregate, postgate, spectrum = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0], n[1], D is not None and n[2], pregate is not None and n[3], postgate is not None and n[4]]
    if grad_y is None or not any(needs):
        return None, None, None, None, None, None, None
    grads = fftconv_bwd(grad_y.contiguous(), u, k, D, pregate, postgate, ctx.gelu, spectrum, needs)
    du, dk, dD, dpre, dpost = (g if need else None for g, need in zip(grads, needs))
    return du, dk, dD, dpre, dpost, None, None


fftconv_op.register_autograd(_backward, setup_context=_setup)
