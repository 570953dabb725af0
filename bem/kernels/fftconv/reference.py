"""PyTorch reference of the fftconv op family: the CPU path, the fallback and the test oracle.

The causal long convolution of Hyena, with its element-wise work:

    v = pregate ⊙ u
    y = postgate ⊙ act( conv(v, k) + D ⊙ v ),   conv(v, k)_t = sum_{s <= t} k[t - s] v_s,   act = GELU or identity

over u, pregate, postgate: (B, H, L), k: (H, Lk), D: (H,). Taps past Lk are zero, taps past L never reach an
output. Arithmetic is float32 (float64 for float64 inputs) whatever the input dtype; y has u's dtype.

- `fftconv_fft`: by real FFTs of size n >= 2L (the next power of two), zero padded: the fallback.
- `fftconv_direct`: the direct causal sum (O(L^2)), the float64 oracle of the tests.
- `fftconv_step`: one decoding step against a kept history of the pregated inputs (updated in place).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fft_size(L: int) -> int:
    """The FFT length of a causal convolution over L positions: the next power of two >= 2L."""
    return 1 << max(1, (2 * L - 1).bit_length())


def compute_dtype(u: torch.Tensor) -> torch.dtype:
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def _check_float(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_operands(
    u: torch.Tensor,
    k: torch.Tensor,
    D: Optional[torch.Tensor],
    pregate: Optional[torch.Tensor],
    postgate: Optional[torch.Tensor],
) -> None:
    """Raise ValueError/TypeError naming the operand for anything the op does not take.

    u: (B, H, L); k: (H, Lk) with Lk >= 1, any float dtype; D: (H,) or None, any float dtype; pregate and
    postgate: u's shape and dtype, or None. All on u's device."""
    _check_float(u, "u")
    if u.dim() != 3:
        raise ValueError(f"u must be 3-D (B, H, L), got shape {tuple(u.shape)}")
    B, H, L = u.shape
    _check_float(k, "k")
    if k.dim() != 2 or k.shape[0] != H or k.shape[1] < 1:
        raise ValueError(f"k must be (H, Lk) = ({H}, Lk >= 1) to match u {tuple(u.shape)}, got {tuple(k.shape)}")
    named = {"k": k}
    if D is not None:
        _check_float(D, "D")
        if tuple(D.shape) != (H,):
            raise ValueError(f"D must be (H,) = ({H},), got {tuple(D.shape)}")
        named["D"] = D
    for name, gate in (("pregate", pregate), ("postgate", postgate)):
        if gate is None:
            continue
        _check_float(gate, name)
        if gate.shape != u.shape:
            raise ValueError(f"{name} must have u's shape {tuple(u.shape)}, got {tuple(gate.shape)}")
        if gate.dtype != u.dtype:
            raise TypeError(f"{name} has dtype {gate.dtype} but u has {u.dtype}; gates take u's dtype")
        named[name] = gate
    for name, t in named.items():
        if t.device != u.device:
            raise ValueError(f"{name} is on {t.device} but u is on {u.device}")


def _finish(conv: torch.Tensor, v: torch.Tensor, D: Optional[torch.Tensor], postgate: Optional[torch.Tensor],
            gelu: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """postgate ⊙ act(conv + D ⊙ v), cast to out_dtype; conv and v in the compute dtype."""
    if D is not None:  # (H,) against (B, H, L) or, in a step, (B, H)
        conv = conv + D.to(conv.dtype).view(-1, *[1] * (v.dim() - 2)) * v
    y = conv
    if gelu:
        y = F.gelu(y)  # exact (erf) GELU
    if postgate is not None:
        y = y * postgate.to(conv.dtype)
    return y.to(out_dtype)


def _pregated(u: torch.Tensor, pregate: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    v = u.to(dtype)
    return v if pregate is None else v * pregate.to(dtype)


def _taps(k: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """k's first min(Lk, L) taps in the compute dtype: taps past L never reach an output."""
    return k[:, :L].to(dtype)


def fftconv_fft(
    u: torch.Tensor,
    k: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    pregate: Optional[torch.Tensor] = None,
    postgate: Optional[torch.Tensor] = None,
    gelu: bool = False,
) -> torch.Tensor:
    """`postgate ⊙ gelu?(conv(pregate ⊙ u, k) + D ⊙ pregate ⊙ u)` by real FFTs of size fft_size(L)."""
    check_operands(u, k, D, pregate, postgate)
    L = u.shape[-1]
    cd = compute_dtype(u)
    v = _pregated(u, pregate, cd)
    n = fft_size(L)
    spectrum = torch.fft.rfft(v, n=n) * torch.fft.rfft(_taps(k, L, cd), n=n)
    conv = torch.fft.irfft(spectrum, n=n)[..., :L]
    return _finish(conv, v, D, postgate, gelu, u.dtype)


def fftconv_direct(
    u: torch.Tensor,
    k: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    pregate: Optional[torch.Tensor] = None,
    postgate: Optional[torch.Tensor] = None,
    gelu: bool = False,
) -> torch.Tensor:
    """The same op as the direct causal sum y_t = sum_{s<=t} k[t-s] v_s (a depthwise conv1d over the
    left-padded input with the flipped filter; O(L^2), for tests)."""
    check_operands(u, k, D, pregate, postgate)
    B, H, L = u.shape
    cd = compute_dtype(u)
    v = _pregated(u, pregate, cd)
    taps = F.pad(_taps(k, L, cd), (0, L - min(L, k.shape[1])))  # (H, L), zero past Lk
    conv = F.conv1d(F.pad(v, (L - 1, 0)), taps.flip(-1)[:, None, :], groups=H)
    return _finish(conv, v, D, postgate, gelu, u.dtype)


def check_position(position: Union[int, torch.Tensor], Lmax: int, device: torch.device) -> None:
    """position: a Python int or a 0-d int64 tensor on u's device (no value check for a CUDA tensor: that
    would wait for the GPU; the kernel writes NaN outputs for an out-of-range one)."""
    if isinstance(position, torch.Tensor):
        if position.dim() != 0 or position.dtype != torch.int64:
            raise TypeError(f"position must be an int or a 0-d int64 tensor, got {position.dtype} "
                            f"of shape {tuple(position.shape)}")
        if position.device != device:
            raise ValueError(f"position is on {position.device} but u_t is on {device}")
        if position.device.type == "cuda":
            return
        value = int(position)
    elif isinstance(position, int) and not isinstance(position, bool):
        value = position
    else:
        raise TypeError(f"position must be an int or a 0-d int64 tensor, got {type(position).__name__}")
    if not 0 <= value < Lmax:
        raise ValueError(f"position must be in [0, {Lmax}) (the history's length), got {value}")


def check_step_operands(
    history: torch.Tensor,
    u_t: torch.Tensor,
    k: torch.Tensor,
    position: Union[int, torch.Tensor],
    D: Optional[torch.Tensor],
    pregate: Optional[torch.Tensor],
    postgate: Optional[torch.Tensor],
) -> None:
    """history: (B, H, Lmax) of u_t's dtype; u_t, pregate, postgate: (B, H); k: (H, Lk); D: (H,)."""
    _check_float(u_t, "u_t")
    if u_t.dim() != 2:
        raise ValueError(f"u_t must be 2-D (B, H), got shape {tuple(u_t.shape)}")
    B, H = u_t.shape
    _check_float(history, "history")
    if history.dim() != 3 or tuple(history.shape[:2]) != (B, H) or history.shape[2] < 1:
        raise ValueError(f"history must be (B, H, Lmax) = ({B}, {H}, Lmax >= 1), got {tuple(history.shape)}")
    if history.dtype != u_t.dtype:
        raise TypeError(f"history has dtype {history.dtype} but u_t has {u_t.dtype}")
    if history.device != u_t.device:
        raise ValueError(f"history is on {history.device} but u_t is on {u_t.device}")
    for name, gate in (("pregate", pregate), ("postgate", postgate)):
        if isinstance(gate, torch.Tensor) and gate.shape != u_t.shape:
            raise ValueError(f"{name} must be (B, H) = ({B}, {H}), got {tuple(gate.shape)}")
    # k, D and the gates: the full op's rules with u_t as a (B, H, 1) sequence
    check_operands(u_t[:, :, None], k, D, None if pregate is None else pregate[:, :, None],
                   None if postgate is None else postgate[:, :, None])
    check_position(position, history.shape[2], u_t.device)


def fftconv_step(
    history: torch.Tensor,
    u_t: torch.Tensor,
    k: torch.Tensor,
    position: Union[int, torch.Tensor],
    D: Optional[torch.Tensor] = None,
    pregate: Optional[torch.Tensor] = None,
    postgate: Optional[torch.Tensor] = None,
    gelu: bool = False,
) -> torch.Tensor:
    """One decoding step at `position` p: writes v_t = pregate_t ⊙ u_t into history[:, :, p] (in place) and
    returns postgate_t ⊙ act( sum_{s<=p} k[p-s] history[:, :, s] + D ⊙ v_t ), shape (B, H), u_t's dtype.

    The current token's own terms use v_t before it is rounded to the history's dtype."""
    check_step_operands(history, u_t, k, position, D, pregate, postgate)
    p = int(position)
    if not 0 <= p < history.shape[2]:  # a CUDA tensor's value is only seen here
        raise ValueError(f"position must be in [0, {history.shape[2]}) (the history's length), got {p}")
    cd = compute_dtype(u_t)
    v_t = _pregated(u_t, pregate, cd)
    history[:, :, p] = v_t.to(history.dtype)
    taps = min(p + 1, k.shape[1])
    past = history[:, :, p - taps + 1:p].to(cd)  # positions p-taps+1 .. p-1
    filt = k[:, :taps].to(cd).flip(-1)  # k[taps-1], ..., k[0]
    conv = (past * filt[:, :-1]).sum(-1) + filt[:, -1] * v_t
    return _finish(conv, v_t, D, postgate, gelu, u_t.dtype)
