"""The fused ops under torch.compile(fullgraph=True) and CUDA graph capture."""

from __future__ import annotations

import pytest
import torch

from bem.kernels import ops

from .kernel_helpers import bound, linear_ref64, operands, rel_err
from bem.kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ops.KERNELS_AVAILABLE, reason="BEM CUDA extension not loaded"),
]


def test_compile_fullgraph_forward_and_backward():
    x, W, b, V, c, U = operands(24, 256, 192, 16, torch.bfloat16, codes=True, seed=11)
    V.requires_grad_()
    U.requires_grad_()

    def step(x, c):
        y = ops.bem_linear(x, W, b, V, c, U, 2.0)
        return (y.float() ** 2).mean()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(x, c)
    loss.backward()
    grads = (V.grad.clone(), U.grad.clone())
    V.grad = U.grad = None
    step(x, c).backward()
    assert torch.allclose(grads[0].float(), V.grad.float(), rtol=2e-2, atol=1e-3)
    assert torch.allclose(grads[1].float(), U.grad.float(), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("M,K,N,r", [(1, 512, 384, 8), (16, 512, 384, 8), (1, 4096, 520, 32), (16, 14336, 384, 8),
                                     (200, 512, 384, 8), (6000, 768, 768, 8)])
def test_cuda_graph_capture_and_replay(M, K, N, r):
    """Decode (on Hopper the streaming kernel: in one launch, then, at rank 32 and with long slices of K,
    after its projection launch, a programmatic dependency the capture must keep), small prefill and
    (M = 6000, 768²) the GEMM with the update inside, where it runs."""
    x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=M)
    static_x, static_c = x.clone(), c.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the capture
            ops.bem_linear(static_x, W, b, V, static_c, U, 1.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = ops.bem_linear(static_x, W, b, V, static_c, U, 1.0)
    for seed in range(3):  # fresh inputs copied in, graph replayed
        x2, _, _, _, c2, _ = operands(M, K, N, r, torch.bfloat16, codes=True, seed=100 + seed)
        static_x.copy_(x2)
        static_c.copy_(c2)
        graph.replay()
        ref = linear_ref64(x2, W, b, V, c2, U, 1.0)
        torch_err = rel_err(reference.bem_linear(x2, W, b, V, c2, U, 1.0), ref)
        assert rel_err(static_y, ref) <= bound(torch_err, torch.bfloat16)
