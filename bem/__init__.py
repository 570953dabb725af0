"""BEM: Bolt-on Expert Modules.

Context-routed low-rank expert modules for the frozen linears of Hugging Face models:

    from bem import HierarchicalBEMConfig, create_hierarchical_bem, BEMModel

    model = create_hierarchical_bem(base_model, HierarchicalBEMConfig(rank=8, alpha=16.0))
    model(input_ids=..., attention_mask=..., labels=...)
    model.save_pretrained("adapter/")
    model = BEMModel.from_pretrained(base_model, "adapter/")

The package, read top-down (each part imports only those above it):
- `config`, `targets`, `io_utils`, `quantization`: settings, attach points, atomic writes, a bitsandbytes base;
- `kernels/`: the ops and their CUDA kernels, by family (the low-rank update and the BEM linear, `fftconv/`,
  `mlstm/`, `quant/`), each with its PyTorch reference;
- `modules/`: the wrapped linear, the routing controller, the mixer blocks;
- `call_inputs`, `call_hooks`, `cache_state`: following each call of the wrapped model and its KV cache;
- `persistence`, `lora_bridge`, `stats`, then `model` (`create_hierarchical_bem`, `BEMModel`);
- `training/`, `profiling/`, `cli`: the `bem train`, `bem generate` and `bem profile` commands.
"""

from .config import HierarchicalBEMConfig
from .model import BEMModel, create_hierarchical_bem

__version__ = "0.1.0"

__all__ = ["BEMModel", "HierarchicalBEMConfig", "create_hierarchical_bem", "__version__"]
