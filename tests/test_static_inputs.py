"""generate's compiled decoding step reads every input that torch.compile takes as static (parameters, buffers,
tensors it reaches through modules, BEM's state on the cache) at one address, step after step and generate after
generate on the same model: inductor's CUDA graphs bake those addresses in, and a new one re-records the graphs
at every step (which made compiled decoding slower than eager decoding)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, CompileConfig, Phi3Config

from bem import HierarchicalBEMConfig, create_hierarchical_bem

from conftest import VOCAB, randomize_bem
from test_decoding_paths import ARCHS, generate, left_padded, wrapped


def static_inputs_per_call(model, ids, mask, generates: int) -> list[dict[str, list[torch.Tensor]]]:
    """Run `generates` compiled generates; per generate, every static input of each compiled call, by placeholder
    name. The tensors are kept alive, so that a freed block cannot come back at the same address and hide a new
    tensor."""
    runs: list[dict[str, list[torch.Tensor]]] = []

    def recording(gm, example_inputs, **options):  # generate passes its compile options (mode, ...) on
        names = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
        static = [i for i, t in enumerate(example_inputs)
                  if isinstance(t, torch.Tensor) and getattr(t, "_dynamo_static_input_type", None) is not None]

        def run(*args):
            for i in static:
                runs[-1].setdefault(names[i], []).append(args[i])
            return gm.forward(*args)

        return run

    config = CompileConfig(backend=recording, fullgraph=True)
    config._compile_all_devices = True
    for _ in range(generates):
        runs.append({})
        generate(model, ids, mask, cache_implementation="static", compile_config=config)
    return runs


def addresses(tensors: list[torch.Tensor]) -> int:
    return len({t.data_ptr() for t in tensors})


def tiny_phi3():
    """Phi-3 (fused projections; some transformers releases give it a prepare_inputs_for_generation of its own)."""
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    model = create_hierarchical_bem(AutoModelForCausalLM.from_config(config).eval(), HierarchicalBEMConfig(
        rank=4, alpha=8.0, chunk_size=3, max_prefix_tokens=5, controller_dim=16, attach_qkv=True))
    randomize_bem(model, seed=5)
    return model


@pytest.mark.parametrize("arch", ARCHS + ["phi3"])
def test_the_compiled_steps_static_inputs_keep_their_addresses(arch, load_base):
    torch._dynamo.reset()
    model = tiny_phi3() if arch == "phi3" else wrapped(load_base, arch, seed=5)
    runs = static_inputs_per_call(model, *left_padded(seed=6), generates=2)
    parameters = {p.data_ptr() for p in model.parameters()}
    for seen in runs:
        assert seen, "generate compiled no decoding step"
        assert any(tensors[0].data_ptr() in parameters for tensors in seen.values()), (
            "no parameter among the static inputs: torch.compile no longer marks them as this test reads")
        moved = {name: addresses(tensors) for name, tensors in seen.items() if addresses(tensors) > 1}
        assert not moved, f"static inputs at a new address from step to step (name: addresses): {moved}"
    # the 2-D mask BEM captures in generate is its own, not the cache's (which a generate that returns it renews)
    masks = [tensors for seen in runs for name, tensors in seen.items() if name.endswith("generate_masks_mask")]
    assert masks and addresses([t for tensors in masks for t in tensors]) == 1
