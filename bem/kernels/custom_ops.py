"""The kernels as `torch.library` custom ops: fake (meta) implementations for `torch.compile`, and
autograd formulas. Ops are registered whether or not the extension loaded; only running them needs it.

    bem::fused_generated_update(x, V, codes, U, s) -> (s ((x V) ⊙ codes) U^T, x V)
    bem::fused_bem_linear(x, W, b, V, codes, U, s) -> (x W^T + b + s ((x V) ⊙ codes) U^T, x V)
    bem::bem_linear_inference(x, W, b, V, codes, U, s) -> x W^T + b + s ((x V) ⊙ codes) U^T   (no autograd)
    bem::lowrank_project(a, b)                     -> a b            (the backward's dY U)
    bem::decode_backward(x, dY, W, V, U, P, codes, s) -> (dX, dV, dcodes, dU) for 1..64 rows
    bem::prefill_backward(x, dY, W, V, U, P, codes, s) -> (dX, dV, dcodes, dU) above that
    bem::backward_coefficients(G, P, codes, s, dtype) -> (s G ⊙ c, s P ⊙ c, s G ⊙ P) in dtype

x is (M, K), V (K, r), U (N, r), codes (M, r) or None, W (N, K) (row-major or a transposed view).
The second output is x V in float32 (float64 for float64 inputs). Autograd keeps x and the codes, as LoRA
keeps x and A x, and the backward recomputes x V from x (one small GEMM) rather than hold M x r float32
values from the forward to the backward; the backward ops take P = None for that.
Backward: with G = dY U,
    dX = dY W + s (G ⊙ c) V^T,  dV = s X^T (G ⊙ c),  dU = s dY^T (P ⊙ c),  dcodes = s G ⊙ P.
W and b are frozen: no dW, no db.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from . import loader


# The extension module or None; looked up on first use (`extension()`), never at import. A plain module global,
# so that torch.compile traces its reads and tests can stand a stub in for it.
_C: Any = loader.NOT_LOOKED


def extension() -> Optional[ModuleType]:
    """The extension module or None (looked up on the first call)."""
    global _C
    if _C is loader.NOT_LOOKED:
        _C = loader.extension()
    return _C


def decode_max_tokens() -> int:
    """Most tokens the one-launch decode kernel takes (0 without the extension)."""
    found = extension()
    return int(getattr(found, "DECODE_MAX_TOKENS", 0)) if found is not None else 0


def decode_auto_max_tokens() -> int:
    """Most tokens for which the fused linear picks the one-launch decode kernel by itself; above that it
    runs the prefill compositions (some of whose kernels read V^T)."""
    return int(getattr(extension(), "DECODE_AUTO_MAX_TOKENS", 16))


def _extension() -> ModuleType:
    found = extension()
    if found is None:
        raise RuntimeError("the BEM CUDA extension is not loaded; bem.kernels.ops routes such calls to the reference")
    return found


def _p_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op("bem::fused_generated_update", mutates_args=())
def fused_generated_update(
    x: Tensor, V: Tensor, codes: Optional[Tensor], U: Tensor, scaling: float
) -> tuple[Tensor, Tensor]:
    return tuple(_extension().update_forward(x, V, codes, U, scaling))


@torch.library.custom_op("bem::fused_bem_linear", mutates_args=())
def fused_bem_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], V: Tensor, codes: Optional[Tensor], U: Tensor, scaling: float
) -> tuple[Tensor, Tensor]:
    return tuple(_extension().linear_forward(x, weight, bias, V, codes, U, scaling))


@torch.library.custom_op("bem::bem_linear_inference", mutates_args=())
def bem_linear_inference(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], V: Tensor, codes: Optional[Tensor], U: Tensor, scaling: float
) -> Tensor:
    """The fused linear without x V as a second output (what the backward would reuse): the kernel the eager
    inference path calls, for compiled inference (a decoding step that generate compiles, say)."""
    return _extension().linear_forward(x, weight, bias, V, codes, U, scaling, 0, 0, False)[0]


@torch.library.custom_op("bem::lowrank_project", mutates_args=())
def lowrank_project(a: Tensor, b: Tensor) -> Tensor:
    return _extension().project(a, b)


@torch.library.custom_op("bem::backward_coefficients", mutates_args=())
def backward_coefficients(
    G: Tensor, P: Tensor, codes: Optional[Tensor], scaling: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    if dtype in (torch.float16, torch.bfloat16):
        return tuple(_extension().backward_coefficients(G, P, codes, scaling, dtype))
    c = 1.0 if codes is None else codes.to(G.dtype)
    return (G * c * scaling).to(dtype), (P * c * scaling).to(dtype), (G * P * scaling).to(dtype)


@torch.library.custom_op("bem::decode_backward", mutates_args=())
def decode_backward(
    x: Tensor, grad_y: Tensor, weight: Optional[Tensor], V: Tensor, U: Tensor, P: Optional[Tensor],
    codes: Optional[Tensor], scaling: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(_extension().decode_backward(x, grad_y, weight, V, U, P, codes, scaling))


@fused_generated_update.register_fake
def _(x, V, codes, U, scaling):
    return x.new_empty(x.shape[0], U.shape[0]), x.new_empty(x.shape[0], V.shape[1], dtype=_p_dtype(x))


@fused_bem_linear.register_fake
def _(x, weight, bias, V, codes, U, scaling):
    return x.new_empty(x.shape[0], U.shape[0]), x.new_empty(x.shape[0], V.shape[1], dtype=_p_dtype(x))


@bem_linear_inference.register_fake
def _(x, weight, bias, V, codes, U, scaling):
    return x.new_empty(x.shape[0], U.shape[0])


@lowrank_project.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1], dtype=_p_dtype(a))


@backward_coefficients.register_fake
def _(G, P, codes, scaling, dtype):
    return G.new_empty(G.shape, dtype=dtype), P.new_empty(P.shape, dtype=dtype), G.new_empty(G.shape, dtype=dtype)


def _kept_or_projected(P: Optional[Tensor], x: Tensor, V: Tensor) -> Tensor:
    """x V as the forward kept it, or recomputed (autograd keeps none: see the module's note)."""
    return P if P is not None else lowrank_project(x, V)


def _grads_from_g(
    x: Tensor, grad_y: Tensor, G: Tensor, P: Tensor, codes: Optional[Tensor], scaling: float, need_v: bool,
    need_u: bool,
) -> tuple[Optional[Tensor], Tensor, Optional[Tensor]]:
    """(dV, dcodes, dU) from G = dY U and P = x V: one kernel for the three coefficient tensors, then the two
    GEMMs dV = x^T (s G ⊙ c) and dU = dY^T (s P ⊙ c), which only stream x and dY."""
    low, pc, dcodes = backward_coefficients(G, P, codes, scaling, x.dtype)
    dv = torch.mm(x.t(), low) if need_v else None
    du = torch.mm(grad_y.t(), pc) if need_u else None
    return dv, dcodes, du


class _ForcedPath:
    """A backward path forced for tests and benchmarks (None: chosen by shape). The extension keeps the choice,
    because the eager autograd function's C++ backward reads it there; `current` mirrors it on the Python side."""

    def __init__(self, what: str, choices: tuple[str, ...], setter: str) -> None:
        self.what, self.choices, self.setter = what, choices, setter
        self.current: Optional[str] = None

    @contextlib.contextmanager
    def force(self, path: Optional[str]) -> Iterator[None]:
        if path is not None and path not in self.choices:
            raise ValueError(f"{self.what} must be one of {self.choices} or None, got {path!r}")
        before, self.current = self.current, path
        self._set_in_extension(path)
        try:
            yield
        finally:
            self.current = before
            self._set_in_extension(before)

    def _set_in_extension(self, path: Optional[str]) -> None:
        found = extension()
        if found is not None:
            getattr(found, self.setter)(-1 if path is None else self.choices.index(path))


PREFILL_DX_PATH = _ForcedPath("prefill dX path", ("update", "gemm"), "set_prefill_dx_path")
PREFILL_GRADS_PATH = _ForcedPath("prefill gradients path", ("composed", "fused"), "set_prefill_grads_path")


def prefill_dx_path(path: Optional[str]) -> contextlib.AbstractContextManager:
    """Force how the prefill backward computes dX, for tests and benchmarks: "update" (the update kernels
    on dY, then cuBLAS adds dY W), "gemm" (the fused GEMM given s (dY U) ⊙ codes, which must take the
    operands) or None (by shape, `_dx_in_gemm`)."""
    return PREFILL_DX_PATH.force(path)


def prefill_grads_path(path: Optional[str]) -> contextlib.AbstractContextManager:
    """Force how the prefill backward computes x V, dY U, the coefficients, dV and dU, for tests and benchmarks:
    "composed" (cuBLAS projections, the coefficient kernel, cuBLAS GEMMs), "fused" (two launches: the coefficients
    from projections summed on chip, then dV and dU; the extension refuses, with ValueError, operands they cannot
    take) or None (the fused launches at rank 8 where the frozen linear's work M K N is small: the extension's
    measured rule)."""
    return PREFILL_GRADS_PATH.force(path)


def _dx_in_gemm(grad_y: Tensor, weight: Tensor, V: Tensor) -> bool:
    """Whether dX = dY W + s (G ⊙ c) V^T comes from the fused GEMM (`gemm_update_given`, W read transposed):
    where the extension's measured rule says so, unless forced (the extension refuses, with ValueError, a forced
    GEMM that cannot take the operands). The eager autograd function's backward makes the same call in C++."""
    return _extension().prefill_dx_in_gemm(grad_y, weight.t(), V)


@torch.library.custom_op("bem::prefill_backward", mutates_args=())
def prefill_backward(
    x: Tensor, grad_y: Tensor, weight: Tensor, V: Tensor, U: Tensor, P: Optional[Tensor], codes: Optional[Tensor],
    scaling: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dX, dV, dcodes, dU) of the BEM linear above decode sizes, in one extension call (backward_ops.cpp):
    dV and dU on a side stream beside dX. Where the fused GEMM takes the operands (and the measured rule
    says so): cuBLAS G = dY U, the coefficient kernel, then one GEMM gives dX = dY W + (s G ⊙ c) V^T.
    Elsewhere the update kernels give dX's low-rank share and G in one pass over dY, and cuBLAS adds dY W.
    float32 and float64, which the coefficient kernel and the fused GEMM do not take: the update kernels on dY,
    cuBLAS, and PyTorch's coefficients."""
    in_gemm = _dx_in_gemm(grad_y, weight, V)
    if x.dtype in (torch.float16, torch.bfloat16):
        return tuple(_extension().prefill_backward(x, grad_y, weight, V, U, P, codes, scaling, in_gemm))
    dx, G = _extension().update_forward(grad_y, U, codes, V, scaling)
    dx.addmm_(grad_y, weight)
    dv, dcodes, du = _grads_from_g(x, grad_y, G, _kept_or_projected(P, x, V), codes, scaling, True, True)
    return dx, dv, dcodes, du


@prefill_backward.register_fake
def _(x, grad_y, weight, V, U, P, codes, scaling):
    M, K, r = x.shape[0], x.shape[1], V.shape[1]
    return x.new_empty(M, K), x.new_empty(K, r), x.new_empty(M, r), x.new_empty(U.shape[0], r)


@decode_backward.register_fake
def _(x, grad_y, weight, V, U, P, codes, scaling):
    M, K, r = x.shape[0], x.shape[1], V.shape[1]
    return x.new_empty(M, K), x.new_empty(K, r), x.new_empty(M, r), x.new_empty(U.shape[0], r)


def _decode_sized(grad_y: Tensor) -> bool:
    """Whether the backward takes the decode-size path: 1..64 fp16/bf16 rows on CUDA (the forward already
    kept the rank within the kernels' maximum)."""
    half = grad_y.dtype in (torch.float16, torch.bfloat16)
    return grad_y.is_cuda and half and 1 <= grad_y.shape[0] <= decode_max_tokens()


def _decode_backward(grad_y, x, V, codes, U, P, scaling, weight, needs):
    """The backward at decode sizes: cuBLAS dY W, and beside it two small kernels for the rest."""
    need_x, need_v, need_codes, need_u = needs
    dx, dv, dcodes, du = decode_backward(x, grad_y, weight if need_x else None, V, U, P, codes, scaling)
    return dx if need_x else None, dv if need_v else None, dcodes if need_codes else None, du if need_u else None


def _prefill_backward(grad_y, x, V, codes, U, P, scaling, weight, needs):
    """The BEM linear's backward above decode sizes, dX asked for."""
    need_x, need_v, need_codes, need_u = needs
    dx, dv, dcodes, du = prefill_backward(x, grad_y, weight, V, U, P, codes, scaling)
    return dx, dv if need_v else None, dcodes if need_codes else None, du if need_u else None


def lowrank_backward(
    grad_y: Tensor,
    x: Tensor,
    V: Tensor,
    codes: Optional[Tensor],
    U: Tensor,
    P: Optional[Tensor],
    scaling: float,
    weight: Optional[Tensor],
    needs: tuple[bool, bool, bool, bool],
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dX, dV, dcodes, dU) for the update (plus dY W when `weight` is given); `needs` in that order. P: x V as
    the forward gave it, or None (recomputed from x and V). The custom ops' autograd formulas, which
    torch.compile traces; eager autograd takes the extension's own function (`_C.fused_linear`), whose C++
    backward makes the same choices."""
    need_x, need_v, need_codes, need_u = needs
    grad_y = grad_y.contiguous()
    if _decode_sized(grad_y):
        return _decode_backward(grad_y, x, V, codes, U, P, scaling, weight, needs)
    if need_x and weight is not None:
        return _prefill_backward(grad_y, x, V, codes, U, P, scaling, weight, needs)
    # dX = s (G ⊙ c) V^T has the forward's form with U and V in the roles of V and U: the forward's
    # dispatch gives dX and G = dY U together.
    P = _kept_or_projected(P, x, V)
    if need_x:
        dx, G = fused_generated_update(grad_y, U, codes, V, scaling)
    else:
        dx, G = None, lowrank_project(grad_y, U) if need_v or need_codes else P
    dv, dcodes, du = _grads_from_g(x, grad_y, G, P, codes, scaling, need_v, need_u)
    return dx, dv, dcodes if need_codes else None, du


def _setup_update(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)  # x V's gradient is always None: no zero tensor for it
    x, V, codes, U, scaling = inputs
    ctx.save_for_backward(x, V, codes, U)  # x V is recomputed in the backward
    ctx.scaling = scaling


def _backward_update(ctx, grad_y, _grad_p):
    if grad_y is None:
        return None, None, None, None, None
    x, V, codes, U = ctx.saved_tensors
    n = ctx.needs_input_grad
    dx, dv, dcodes, du = lowrank_backward(grad_y, x, V, codes, U, None, ctx.scaling, None, (n[0], n[1], n[2], n[3]))
    return dx, dv, dcodes, du, None


def _setup_linear(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    x, weight, _bias, V, codes, U, scaling = inputs
    ctx.save_for_backward(x, weight, V, codes, U)  # x V is recomputed in the backward
    ctx.scaling = scaling


def _backward_linear(ctx, grad_y, _grad_p):
    if grad_y is None:
        return None, None, None, None, None, None, None
    x, weight, V, codes, U = ctx.saved_tensors
    n = ctx.needs_input_grad
    dx, dv, dcodes, du = lowrank_backward(grad_y, x, V, codes, U, None, ctx.scaling, weight,
                                          (n[0], n[3], n[4], n[5]))
    return dx, None, None, dv, dcodes, du, None


fused_generated_update.register_autograd(_backward_update, setup_context=_setup_update)
fused_bem_linear.register_autograd(_backward_linear, setup_context=_setup_linear)
