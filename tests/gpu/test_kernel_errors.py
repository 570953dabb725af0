"""Bad input to the extension is refused before any launch, with a message naming the problem."""

from __future__ import annotations

import pytest
import torch

from bem.kernels import custom_ops, ops
from .kernel_helpers import bound, linear_ref64, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ops.KERNELS_AVAILABLE, reason="BEM CUDA extension not loaded"),
]


def _args(dtype=torch.bfloat16):
    x = torch.randn(4, 32, device="cuda", dtype=dtype)
    V = torch.randn(32, 8, device="cuda", dtype=dtype)
    U = torch.randn(16, 8, device="cuda", dtype=dtype)
    return x, V, U


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda x, V, U: (x.t().contiguous().t(), V, U), "x must be contiguous"),
        (lambda x, V, U: (x, V.float(), U), "V has dtype"),
        (lambda x, V, U: (x, V, U[:, :4].contiguous()), "U has rank"),
        (lambda x, V, U: (x, V[:31].contiguous(), U), "V has 31 rows"),
        (lambda x, V, U: (x.cpu(), V, U), "x must be a CUDA tensor"),
        (lambda x, V, U: (x, V, U.cpu()), "U is on cpu"),
        (lambda x, V, U: (x.to(torch.int32), V, U), "unsupported dtype"),
        (lambda x, V, U: (x[None], V, U), "x must be 2-D"),
    ],
)
def test_update_forward_rejects(mutate, message):
    x, V, U = mutate(*_args())
    with pytest.raises(ValueError, match=message):
        custom_ops._C.update_forward(x, V, None, U, 1.0)


def test_linear_forward_rejects_bad_weight_layout_and_rank():
    x, V, U = _args()
    W = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)[:, ::2]
    with pytest.raises(ValueError, match="weight must be row-major"):
        custom_ops._C.linear_forward(x, W, None, V, None, U, 1.0)
    with pytest.raises(ValueError, match="exceeds the kernels' maximum"):
        big = torch.randn(32, 129, device="cuda", dtype=torch.bfloat16)
        custom_ops._C.update_forward(x, big, None, torch.randn(16, 129, device="cuda", dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="codes must be"):
        custom_ops._C.update_forward(x, V, torch.randn(3, 8, device="cuda", dtype=torch.bfloat16), U, 1.0)
    with pytest.raises(ValueError, match="decode kernel takes"):
        custom_ops._C.linear_forward(torch.randn(65, 32, device="cuda", dtype=torch.bfloat16),
                                     torch.randn(16, 32, device="cuda", dtype=torch.bfloat16), None, V, None, U, 1.0, 1)


@pytest.mark.parametrize("make_v_t,message", [
    (lambda V: V.t().contiguous()[:, :31], "V_t must be contiguous"),
    (lambda V: V.contiguous(), "V_t must be V transposed"),
    (lambda V: V.t().contiguous().float(), "V_t has dtype"),
    (lambda V: V.t().contiguous().cpu(), "V_t is on cpu"),
])
def test_linear_forward_rejects_a_bad_v_transposed(make_v_t, message):
    x, V, U = _args()
    W = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        custom_ops._C.linear_forward(x, W, None, V, None, U, 1.0, V_t=make_v_t(V))


def test_dispatch_handles_what_the_kernels_refuse():
    """Rank over 128 and a strided weight reach the reference or a copy, never a refused launch."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(3, 32, device="cuda", dtype=torch.bfloat16, generator=g)
    V = torch.randn(32, 130, device="cuda", dtype=torch.bfloat16, generator=g)
    U = torch.randn(16, 130, device="cuda", dtype=torch.bfloat16, generator=g)
    assert ops.fused_unavailable_reason(x, V) is not None
    assert ops.generated_update(x, V, None, U, 1.0).shape == (3, 16)
    W = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, generator=g)[:, ::2]
    V8, U8 = V[:, :8].contiguous(), U[:, :8].contiguous()
    out = ops.bem_linear(x, W, None, V8, None, U8, 1.0)
    ref = linear_ref64(x, W, None, V8, None, U8, 1.0)
    torch_err = rel_err(x @ W.t() + (x @ V8) @ U8.t(), ref)
    assert rel_err(out, ref) <= bound(torch_err, torch.bfloat16)


def test_kernel_choice_arguments_are_checked():
    x, V, U = _args()
    with pytest.raises(ValueError, match="unknown update kernel 7"):
        custom_ops._C.update_forward(x, V, None, U, 1.0, 7)
    with pytest.raises(ValueError, match="stream_tokens must be 0 .chosen by shape., 16, 32 or 64, got 48"):
        custom_ops._C.update_forward(x, V, None, U, 1.0, 1, 48)
    wide = torch.randn(x.shape[1], 40, device="cuda", dtype=x.dtype)
    with pytest.raises(ValueError, match="stream_tokens = 64 takes ranks up to 32, got rank 40"):
        custom_ops._C.update_forward(x, wide, None, torch.randn(16, 40, device="cuda", dtype=x.dtype), 1.0, 1, 64)
    with pytest.raises(ValueError, match="stream_cluster must be 0 .chosen by shape., 1, 2, 4 or 8, got 3"):
        custom_ops._C.update_forward(x, V, None, U, 1.0, 1, 0, 3)
    if torch.cuda.get_device_capability()[0] < 9:
        with pytest.raises(ValueError, match="stream_cluster above 1 needs thread-block clusters"):
            custom_ops._C.update_forward(x, V, None, U, 1.0, 1, 0, 2)
    W = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown linear mode 12"):
        custom_ops._C.linear_forward(x, W, None, V, None, U, 1.0, 12)
    with pytest.raises(ValueError, match="gemm_tile_n must be 0 .chosen by shape., 128 or 256, got 64"):
        custom_ops._C.linear_forward(x, W, None, V, None, U, 1.0, 6, gemm_tile_n=64)
    if torch.cuda.get_device_capability()[0] >= 9:  # the streaming decode kernel runs on Hopper
        with pytest.raises(ValueError, match="1, 2, 4 or 8 blocks, got split_k = 3"):
            custom_ops._C.linear_forward(x, W, None, V, None, U, 1.0, 1, 3)
        few = x[:2].contiguous()  # the transposed-weight decode kernel: up to 4 tokens
        with pytest.raises(ValueError, match="transposed-weight decode kernel splits K over 1, 2, 4 or 8 blocks, "
                                             "got split_k = 3"):
            custom_ops._C.linear_forward(few, W.t().contiguous().t(), None, V, None, U, 1.0, 1, 3)
        with pytest.raises(ValueError, match=r"the row-split decode kernel does not split K \(split_k = 0\), "
                                             "got split_k = 3"):
            custom_ops._C.linear_forward(x, W, None, V, None, U, 1.0, 8, 3)
        long_x, long_W = torch.randn(4, 2056, device="cuda", dtype=x.dtype), torch.randn(16, 2056, device="cuda",
                                                                                          dtype=x.dtype)
        with pytest.raises(ValueError, match="K a multiple of 8 up to 2048"):
            custom_ops._C.linear_forward(long_x, long_W, None, torch.randn(2056, 8, device="cuda", dtype=x.dtype),
                                         None, U, 1.0, 8)
        with pytest.raises(ValueError, match="the row-split decode kernel takes a row-major weight, 1..16 tokens"):
            custom_ops._C.linear_forward(x, W.t().contiguous().t(), None, V, None, U, 1.0, 8)
        with pytest.raises(ValueError, match="the TMA decode kernel takes a row-major weight, 1..16 tokens, ranks "
                                             "1..64, K a multiple of 8"):
            custom_ops._C.linear_forward(x, W.t().contiguous().t(), None, V, None, U, 1.0, 9)
        if custom_ops._C.fused_gemm_available():
            with pytest.raises(ValueError, match="the TMA decode kernel splits K over 1, 2, 4 or 8 blocks, got split_k = 3"):
                custom_ops._C.linear_forward(x, W, None, V, None, U, 1.0, 9, 3)


@pytest.mark.skipif(not ops.KERNELS_AVAILABLE or not custom_ops._C.fused_gemm_available(),
                    reason="the GEMM with the update inside needs a compute capability 9.0 GPU and an sm_90a build")
def test_gemm_with_the_update_inside_rejects_what_it_cannot_take():
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    V, U = torch.randn(64, 12, device="cuda", dtype=torch.bfloat16), torch.randn(40, 12, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the fused GEMM takes a row-major weight or the transpose of one, K, N "
                                         "and the rank multiples of 8"):
        custom_ops._C.linear_forward(x, W, None, V, None, U, 1.0, 6)
    V8, U8 = V[:, :8].contiguous(), U[:, :8].contiguous()
    strided = torch.randn(40, 128, device="cuda", dtype=torch.bfloat16)[:, ::2]  # neither layout
    with pytest.raises(ValueError, match=r"weight must be row-major \(N, K\) or the transpose of a row-major "
                                         r"\(K, N\) tensor; got strides \[128, 2\]"):
        custom_ops._C.linear_forward(x, strided, None, V8, None, U8, 1.0, 6)


@pytest.mark.skipif(not ops.KERNELS_AVAILABLE or not custom_ops._C.fused_gemm_available(),
                    reason="the GEMM with the update inside needs a compute capability 9.0 GPU and an sm_90a build")
def test_gemm_given_the_projection_rejects_what_it_cannot_take():
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    U, Pc = torch.randn(40, 8, device="cuda", dtype=torch.bfloat16), torch.randn(300, 8, device="cuda", dtype=torch.bfloat16)
    assert custom_ops._C.gemm_update_given_takes(x, W, U) and custom_ops._C.gemm_update_given_takes(x, W.t().contiguous().t(), U)
    cases = [
        ((x, W[:, ::2], None, Pc[:, :4].contiguous(), U[:, :4].contiguous()), "weight must be .N, K. = .40, 64., got .40, 32."),
        ((x, W, None, Pc[:299], U), r"Pc must be \(M, r\) = \(300, 8\), got \[299, 8\]"),
        ((x, W, None, Pc.half(), U), "Pc has dtype"),
        ((x, W, torch.zeros(39, device="cuda", dtype=torch.bfloat16), Pc, U), "bias must be .N,. = .40,."),
        ((x.float(), W.float(), None, Pc.float(), U.float()), "float16 or bfloat16, got Float"),
        ((x, W, None, torch.randn(300, 12, device="cuda", dtype=torch.bfloat16),
          torch.randn(40, 12, device="cuda", dtype=torch.bfloat16)), "rank multiples of 8.* rank 12"),
        ((x, torch.randn(80, 64, device="cuda", dtype=torch.bfloat16)[::2], None, Pc, U), "transpose of a row-major"),
        ((x.cpu(), W, None, Pc, U), "x must be a CUDA tensor"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            custom_ops._C.gemm_update_given(*args)
    with pytest.raises(ValueError, match="tile_n must be 0 .chosen by shape., 128 or 256, got 64"):
        custom_ops._C.gemm_update_given(x, W, None, Pc, U, 64)
    assert not custom_ops._C.gemm_update_given_takes(x, W[:, :36], U)
    assert not custom_ops._C.gemm_update_given_takes(x.float(), W.float(), U.float())


def test_forcing_the_gemm_dx_path_on_operands_it_cannot_take_is_refused():
    """A rank that is not a multiple of 8: the prefill backward's fused-GEMM dX path is refused by name. The
    extension raises ValueError: so it reaches Python from the custom op's backward; from eager autograd's C++
    backward the autograd engine rethrows it as a RuntimeError with the same message."""
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16)
    V = torch.randn(64, 12, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    U = torch.randn(40, 12, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    message = "the fused GEMM does not take this backward's operands.*V \\(64, 12\\)"
    for y, error in ((ops.bem_linear(x, W, None, V, None, U, 1.0), RuntimeError),
                     (custom_ops.fused_bem_linear(x, W, None, V, None, U, 1.0)[0], ValueError)):
        with custom_ops.prefill_dx_path("gemm"), pytest.raises(error, match=message):
            y.float().sum().backward()


@pytest.mark.skipif(not ops.KERNELS_AVAILABLE or not custom_ops._C.fused_gemm_available(),
                    reason="the TMA update kernel needs a compute capability 9.0 GPU and an sm_90a build")
def test_tma_update_rejects_what_it_cannot_take():
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    V = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16)
    U = torch.randn(36, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the TMA update kernel writes Y .* got K = 64, N = 36, rank 8"):
        custom_ops._C.update_forward(x, V, None, U, 1.0, 4)
    with pytest.raises(ValueError, match="the TMA update kernel needs float16/bfloat16 operands"):
        custom_ops._C.update_forward(x.float(), V.float(), None, U[:32].float(), 1.0, 4)
    with pytest.raises(ValueError, match="rank 72"):
        custom_ops._C.update_forward(x, torch.randn(64, 72, device="cuda", dtype=torch.bfloat16), None,
                                     torch.randn(32, 72, device="cuda", dtype=torch.bfloat16), 1.0, 4)


def _grad_args(M=3, K=40, N=24, r=8, dtype=torch.bfloat16):
    def t(*shape, dt=dtype):
        return torch.randn(*shape, device="cuda", dtype=dt)
    # x, grad_y, weight, V, U, P, codes
    return t(M, K), t(M, N), t(N, K), t(K, r), t(N, r), t(M, r, dt=torch.float32), t(M, r)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda x, dy, W, V, U, P, c: (x.float(), dy.float(), W.float(), V.float(), U.float(), P, c.float()),
         "takes float16 or bfloat16"),
        (lambda x, dy, W, V, U, P, c: (x, dy.half(), W, V, U, P, c), "grad_y has dtype"),
        (lambda x, dy, W, V, U, P, c: (x, dy[:2].contiguous(), W, V, U, P, c), r"grad_y must be \(M, N\) = \(3, 24\)"),
        (lambda x, dy, W, V, U, P, c: (x, dy.t().contiguous().t(), W, V, U, P, c), "grad_y must be contiguous"),
        (lambda x, dy, W, V, U, P, c: (x, dy, W[:, :39], V, U, P, c), r"weight must be \(N, K\) = \(24, 40\)"),
        (lambda x, dy, W, V, U, P, c: (x, dy, W.half(), V, U, P, c), "weight has dtype"),
        (lambda x, dy, W, V, U, P, c: (x, dy, W, V[:39].contiguous(), U, P, c), "V has 39 rows"),
        (lambda x, dy, W, V, U, P, c: (x, dy, W, V, U[:, :4].contiguous(), P, c), "U has rank"),
        (lambda x, dy, W, V, U, P, c: (x, dy, W, V, U, P.bfloat16(), c), "P must be float32"),
        (lambda x, dy, W, V, U, P, c: (x, dy, W, V, U, P[:, :4].contiguous(), c), r"P must be \(M, r\)"),
        (lambda x, dy, W, V, U, P, c: (x, dy, W, V, U, P, c[:, :4].contiguous()), "codes must be"),
        (lambda x, dy, W, V, U, P, c: (x, dy, W, V, U, P.cpu(), c), "P is on cpu"),
        (lambda x, dy, W, V, U, P, c: (x.cpu(), dy, W, V, U, P, c), "x must be a CUDA tensor"),
    ],
)
def test_decode_backward_rejects(mutate, message):
    args = mutate(*_grad_args())
    with pytest.raises(ValueError, match=message):
        custom_ops._C.decode_backward(*args, 1.0)


@pytest.mark.parametrize("trained", ["weight", "bias"])
def test_eager_fused_linear_refuses_a_trainable_weight_or_bias(trained):
    """The extension's autograd function gives W and b no gradient, so it refuses them trainable, by name; the
    dispatch (`ops.bem_linear`) never hands it one and trains them through the checked path instead."""
    x = torch.randn(4, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=trained == "weight")
    b = torch.randn(40, device="cuda", dtype=torch.bfloat16, requires_grad=trained == "bias")
    V = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    U = torch.randn(40, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="the weight and bias must not require grad"):
        custom_ops._C.fused_linear(x, W, b, V, None, U, 1.0)
    y = ops.bem_linear(x, W, b, V, None, U, 1.0)
    assert "FusedLinearFunction" not in y.grad_fn.name()
    y.float().sum().backward()
    assert (W.grad if trained == "weight" else b.grad) is not None


def test_decode_backward_rejects_more_rows_than_decode_sizes_and_rank_over_128():
    with pytest.raises(ValueError, match=r"takes 1..64 rows, got M = 65"):
        custom_ops._C.decode_backward(*_grad_args(M=65), 1.0)
    with pytest.raises(ValueError, match=r"rank 129 exceeds the kernels' maximum of 128"):
        custom_ops._C.decode_backward(*_grad_args(r=129), 1.0)


def test_backward_coefficients_rejects():
    G = torch.randn(5, 8, device="cuda")
    P = torch.randn(5, 8, device="cuda")
    c = torch.randn(5, 8, device="cuda", dtype=torch.bfloat16)
    cases = [
        ((G, P, c, 1.0, torch.float32), "float16 or bfloat16"),
        ((G.bfloat16(), P, c, 1.0, torch.bfloat16), "G must be float32"),
        ((G, P[:, :4].contiguous(), c, 1.0, torch.bfloat16), r"P must be \(M, r\)"),
        ((G, P, c.half(), 1.0, torch.bfloat16), "codes has dtype"),
        ((G, P, c[:4].contiguous(), 1.0, torch.bfloat16), "codes must be"),
        ((G.cpu(), P, c, 1.0, torch.bfloat16), "G must be a CUDA tensor"),
        ((G, P.cpu(), c, 1.0, torch.bfloat16), "P is on cpu but G is on cuda"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            custom_ops._C.backward_coefficients(*args)
