"""The single dispatch point of the fftconv family: the CUDA kernels or the reference.

`fftconv` and `fftconv_step` run the kernels when the extension is loaded, the tensors are on CUDA, the
dtype is one the kernels take and use_fused is on; `fftconv_unavailable_reason` / `step_unavailable_reason`
say why the reference runs otherwise. Operands are checked here, before anything runs, and again in C++.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Optional, Union

import torch

from . import custom_ops, reference

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fftconv_unavailable_reason(u: torch.Tensor, k: Optional[torch.Tensor] = None,
                               use_fused: bool = True) -> Optional[str]:
    """None when the kernels take this call, else why the reference runs instead."""
    if not use_fused:
        return "use_fused is False"
    if u.device.type != "cuda":
        return f"the tensors are on {u.device}, the kernels run on CUDA"
    if custom_ops.extension() is None:
        return "the CUDA extension with the fftconv kernels is not loaded"
    if u.dtype not in KERNEL_DTYPES:
        return f"dtype {u.dtype} has no kernel (float16, bfloat16, float32 do)"
    if k is not None and k.dtype not in KERNEL_DTYPES:
        return f"k's dtype {k.dtype} has no kernel (float16, bfloat16, float32 do)"
    if u.numel() == 0:
        return "the input is empty"
    return None


def _kernel_d(D: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """D in a dtype the kernels read (a float64 D, H values, is cast; autograd casts its gradient back)."""
    return D.float() if D is not None and D.dtype == torch.float64 else D


class SpectrumCache:
    """The filter's spectrum kept per k tensor at inference: reused while the same k object, unchanged (its
    version counter) and alive, is convolved over sequences of the same spectrum length. Entries die with
    their k. Never used where autograd needs k, while compiling, while a CUDA graph is being captured (the
    graph must own what it reads), or for inference-mode tensors (no version counter)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: OrderedDict[int, tuple] = OrderedDict()

    @staticmethod
    def applies(u: torch.Tensor, k: torch.Tensor) -> bool:
        if torch.compiler.is_compiling():
            return False
        if u.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        if torch.is_grad_enabled() and k.requires_grad:
            return False
        return not k.is_inference()

    def get(self, k: torch.Tensor, L: int) -> torch.Tensor:
        key = id(k)
        state = (k._version, k.data_ptr(), k.dtype, custom_ops.spectrum_length(L))
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is k and entry[1] == state:
            self._entries.move_to_end(key)
            return entry[2]
        spectrum = custom_ops.fftconv_spectrum(k, L)
        entries = self._entries
        self._entries[key] = (weakref.ref(k, lambda _, key=key: entries.pop(key, None)), state, spectrum)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return spectrum

    def clear(self) -> None:
        self._entries.clear()


SPECTRA = SpectrumCache()


def fftconv(
    u: torch.Tensor,
    k: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    pregate: Optional[torch.Tensor] = None,
    postgate: Optional[torch.Tensor] = None,
    gelu: bool = False,
    use_fused: bool = True,
) -> torch.Tensor:
    """`postgate ⊙ gelu?( conv(pregate ⊙ u, k) + D ⊙ (pregate ⊙ u) )`, causal, over the last dimension.

    u, pregate, postgate: (B, H, L), any L >= 1; k: (H, Lk) (taps past Lk are zero, past L unused); D: (H,).
    Gates take u's dtype; k and D any float dtype. Returns y, (B, H, L) in u's dtype; float32 arithmetic.
    Differentiable in u, k, D and both gates."""
    reference.check_operands(u, k, D, pregate, postgate)
    if fftconv_unavailable_reason(u, k, use_fused) is not None:
        return reference.fftconv_fft(u, k, D, pregate, postgate, gelu)
    contiguous = [None if t is None else t.contiguous() for t in (u, k, _kernel_d(D), pregate, postgate)]
    u, k, D, pregate, postgate = contiguous
    spectrum = SPECTRA.get(k, u.shape[-1]) if SpectrumCache.applies(u, k) else None
    return custom_ops.fftconv(u, k, D, pregate, postgate, bool(gelu), spectrum)


def step_unavailable_reason(history: torch.Tensor, u_t: torch.Tensor, k: Optional[torch.Tensor] = None,
                            use_fused: bool = True) -> Optional[str]:
    """None when the step kernel takes this call, else why the reference runs instead."""
    reason = fftconv_unavailable_reason(u_t[:, :, None], k, use_fused)
    if reason is None and not history.is_contiguous():
        return "the history is not contiguous (the kernel writes into it in place)"
    return reason


def fftconv_step(
    history: torch.Tensor,
    u_t: torch.Tensor,
    k: torch.Tensor,
    position: Union[int, torch.Tensor],
    D: Optional[torch.Tensor] = None,
    pregate: Optional[torch.Tensor] = None,
    postgate: Optional[torch.Tensor] = None,
    gelu: bool = False,
    use_fused: bool = True,
) -> torch.Tensor:
    """One decoding step: writes pregate_t ⊙ u_t into history[:, :, position] and returns
    postgate_t ⊙ gelu?( sum_{s<=position} k[position-s] history[:, :, s] + D ⊙ pregate_t ⊙ u_t ).

    history: (B, H, Lmax) of u_t's dtype, updated in place; u_t, pregate_t, postgate_t: (B, H); position: an
    int or a 0-d int64 tensor on u_t's device (then CUDA graphs and torch.compile reuse one graph for every
    step; an out-of-range tensor value gives NaN outputs on the kernel path, where checking it would wait for
    the GPU). Returns (B, H) in u_t's dtype."""
    reference.check_step_operands(history, u_t, k, position, D, pregate, postgate)
    if step_unavailable_reason(history, u_t, k, use_fused) is not None:
        return reference.fftconv_step(history, u_t, k, position, D, pregate, postgate, gelu)
    u_t, k, D, pregate, postgate = (None if t is None else t.contiguous()
                                    for t in (u_t, k, _kernel_d(D), pregate, postgate))
    if isinstance(position, torch.Tensor):
        return custom_ops.fftconv_step(history, u_t, k, position, 0, D, pregate, postgate, bool(gelu))
    return custom_ops.fftconv_step(history, u_t, k, None, int(position), D, pregate, postgate, bool(gelu))
