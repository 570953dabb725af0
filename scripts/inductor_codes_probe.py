"""How many kernels inductor makes when each of M opaque ops reads one module's slice of a pointwise result,
with and without `bem::codes_buffer` between them (on the CPU: inductor's C++ kernels, same scheduling).

    PYTHONPATH=. python scripts/inductor_codes_probe.py [--modules 12]

The toy has the controller's combine (norm, clamp, gate, static codes, cast, permute) and a chain of blocks of
three opaque custom ops, each on its own codes slice and all on the block's input (as q, k and v read theirs),
then one pointwise sum and ReLU.
"""

from __future__ import annotations

import argparse
import re

import torch
from torch._inductor.utils import run_and_get_code

from bem.modules.codes_buffer import codes_buffer


@torch.library.custom_op("bemprobe::layer", mutates_args=())
def layer(x: torch.Tensor, codes: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    return x + codes @ U


@layer.register_fake
def _(x, codes, U):
    return torch.empty_like(x)


def combine(dynamic: torch.Tensor, gate: torch.Tensor, static: torch.Tensor) -> torch.Tensor:
    scale = 3.0 / torch.clamp(torch.linalg.vector_norm(dynamic, dim=-1, keepdim=True), min=3.0)
    g = gate.unsqueeze(-1)
    return torch.addcmul(g * static, dynamic, g * scale).permute(2, 0, 1, 3).to(torch.bfloat16).contiguous()


def kernels(modules: int, buffered: bool) -> int:
    """Kernel launches of one compiled call (inductor reuses one kernel's code for identical work)."""
    rank, width = 8, 16

    def model(x, dynamic, gate, static, U):
        codes = combine(dynamic, gate, static)
        if buffered:
            codes = codes_buffer(codes)
        for block in range(modules // 3):  # three layers read the same input, as q, k and v do
            q, k, v = (layer(x, codes[3 * block + i].reshape(-1, rank), U) for i in range(3))
            x = torch.relu(q + k + v)
        return x

    inputs = (torch.randn(1, width, dtype=torch.bfloat16), torch.randn(1, 1, modules, rank), torch.rand(1, 1, 1),
              torch.ones(modules, rank), torch.randn(rank, width, dtype=torch.bfloat16))
    torch._dynamo.reset()
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(model, fullgraph=True), *inputs)
    source = "\n".join(code)
    call = source[source.index("def call("):]  # the wrapper that runs the kernels, in order
    return len(re.findall(r"\bcpp_fused_\w+\(", call))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", type=int, default=12)
    args = parser.parse_args()
    for buffered in (False, True):
        print(f"{args.modules} modules, {'through' if buffered else 'without'} bem::codes_buffer: "
              f"{kernels(args.modules, buffered)} kernel launches")


if __name__ == "__main__":
    main()
