"""BEM: Bolt-on Expert Modules.

Context-routed low-rank expert modules for the frozen linears of Hugging Face models:

    from bem import HierarchicalBEMConfig, create_hierarchical_bem, BEMModel

    model = create_hierarchical_bem(base_model, HierarchicalBEMConfig(rank=8, alpha=16.0))
    model(input_ids=..., attention_mask=..., labels=...)
    model.save_pretrained("adapter/")
    model = BEMModel.from_pretrained(base_model, "adapter/")
"""

from .config import HierarchicalBEMConfig
from .model import BEMModel, create_hierarchical_bem

__version__ = "0.1.0"

__all__ = ["BEMModel", "HierarchicalBEMConfig", "create_hierarchical_bem", "__version__"]
