"""Does the controller's captured whole-sequence call keep working after cuBLAS's workspaces are cleared, when an
earlier, since dropped CUDA graph was the first capture on the shared capture stream? (The hypothesis for the
pair crash in notes/device_plan.md: inductor's CUDA-graph trees clear the workspaces around their recording.)

    PYTHONPATH=. python scripts/cublas_workspace_probe.py [--no-foreign] [--no-fix]

1. unless --no-foreign: a matrix product captured by hand with `torch.cuda.graph` (the first capture on its
   class-level capture stream), then the graph dropped;
2. a small BEM Llama's full forward three times without grad: the controller's whole-sequence call runs
   eagerly, is captured, is replayed;
3. `torch._C._cuda_clearCublasWorkspaces()` and `torch.cuda.empty_cache()`, which unmaps whatever memory was
   freed (a replay that still writes there faults);
4. the forward again (a replay), synchronised: its logits against the first, eager forward's.

The controller clears the workspaces before and after each of its captures (`_clear_cublas_workspaces`, as
inductor does around its own), so that a capture's workspace comes from the graph's own pool; --no-fix turns
that off. Prints one line: the memory the capture kept, and the largest difference or the error the replay
raised.
"""

from __future__ import annotations

import argparse
import gc

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.modules import controller_graphs


def foreign_capture() -> None:
    a = torch.randn(256, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a @ a  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b = a @ a
    graph.replay()
    torch.cuda.synchronize()
    del graph, b
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-foreign", action="store_true", help="no capture by hand before the model's")
    parser.add_argument("--no-fix", action="store_true", help="keep the workspaces around the controller's captures")
    args = parser.parse_args()
    if args.no_fix:
        controller_graphs._clear_cublas_workspaces = lambda: None
    if not args.no_foreign:
        foreign_capture()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    base = AutoModelForCausalLM.from_config(config).to("cuda").eval()
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=8, chunk_size=4, max_prefix_tokens=6))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and param.dim() == 2 and not name.endswith("static_codes"):
                param.normal_(std=0.1)
        ids = torch.randint(3, 101, (2, 17), device="cuda")
        eager = model(input_ids=ids, use_cache=False).logits.clone()  # the controller's call: eager
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        model(input_ids=ids, use_cache=False)  # captured
        torch.cuda.synchronize()
        kept_mib = (torch.cuda.memory_reserved() - reserved) / 2**20
        model(input_ids=ids, use_cache=False)  # replayed
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        try:
            again = model(input_ids=ids, use_cache=False).logits
            torch.cuda.synchronize()
            print(f"foreign capture {not args.no_foreign}, fix {not args.no_fix}: capture kept {kept_mib:.1f} MiB; "
                  f"replay after clearing, max |diff| {(again - eager).abs().max().item():.3g}")
        except Exception as error:  # noqa: BLE001 - the probe reports whatever the replay raised
            print(f"foreign capture {not args.no_foreign}, fix {not args.no_fix}: capture kept {kept_mib:.1f} MiB; "
                  f"replay after clearing raised "
                  f"{type(error).__name__}: {str(error).splitlines()[0]}")


if __name__ == "__main__":
    main()
