"""What a training step's controller holds on the GPU until the backward: the hidden states it reads go to host
memory (`HostCopy`), and the codes and gradients are those of the controller that keeps them on the GPU."""

from __future__ import annotations

import pytest
import torch

from bem.modules import controller as controller_module
from bem.modules.controller import HierarchicalController

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

B, T, H = 2, 4099, 2048  # 32 MiB of bf16 hidden states


def _run(dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    controller = HierarchicalController(hidden_size=H, num_modules=6, rank=8, token_module_indices=[1, 4],
                                        controller_dim=64, chunk_size=32).to("cuda").train()
    with torch.no_grad():  # drawn in float32, then cast: the same values in every dtype
        for name, param in controller.named_parameters():
            if param.dim() >= 1 and name != "static_codes":
                param.normal_(std=0.05)
    controller.to(dtype)
    dcodes = torch.randn(6, B, T, 8, device="cuda").to(dtype)
    # a first call on a short input: what the first calls of a process allocate for good (cuBLAS's workspace
    # for this stream, 32 MiB, about the size of the hidden states below) is not counted as held
    controller(torch.randn(B, 64, H, device="cuda").to(torch.bfloat16), out_dtype=dtype).codes.sum().backward()
    controller.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    # every block from here on comes from a fresh segment: a cached block left by an earlier test can be handed out
    # whole (up to 1 MiB more than asked), which would make what is held depend on the tests run before
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    hidden = torch.randn(B, T, H, device="cuda").to(torch.bfloat16)
    codes = controller(hidden, out_dtype=dtype).codes
    del hidden  # the caller's reference: what the autograd graph holds of it is all that is left
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # lets the allocator take back blocks whose side-stream uses have ended
    held = torch.cuda.memory_allocated() - before  # what the forward left for the backward, the codes included
    codes.backward(dcodes)
    grads = {name: param.grad.clone() for name, param in controller.named_parameters()}
    return codes.detach(), grads, held


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_controller_sends_its_input_to_host_memory_with_the_same_gradients(dtype, monkeypatch):
    codes, grads, held = _run(dtype, seed=5)
    monkeypatch.setattr(controller_module, "host_copy_applies", lambda tensor: False)
    plain_codes, plain_grads, plain_held = _run(dtype, seed=5)
    hidden_bytes = B * T * H * 2
    # kept on the GPU, the input is what the plain controller holds more (and all it holds more)
    assert 0.95 * hidden_bytes <= plain_held - held <= 1.05 * hidden_bytes, (held / 2**20, plain_held / 2**20)
    # the same math on the same values, so as close to a float64 controller as the plain one is: the chunk
    # sums' scatter_add adds in any order on a GPU, so the two need not agree bit for bit, and in bf16 a
    # reordered sum of 8,198 tokens moves a gradient by more than any fixed tolerance would allow
    ref_codes, ref_grads, _ = _run(torch.float64, seed=5)
    eps = torch.finfo(dtype).eps
    for name, got, plain, ref in [("codes", codes, plain_codes, ref_codes),
                                  *((n, grads[n], plain_grads[n], ref_grads[n]) for n in ref_grads)]:
        err = (got.double() - ref).abs().max().item()
        plain_err = (plain.double() - ref).abs().max().item()
        assert err <= 2 * plain_err + eps * ref.abs().max().item(), (name, err, plain_err)
