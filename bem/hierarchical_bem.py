"""The seed's module name for the public entry points: `from bem.hierarchical_bem import ...`."""

from .config import HierarchicalBEMConfig
from .model import BEMModel, create_hierarchical_bem

__all__ = ["BEMModel", "HierarchicalBEMConfig", "create_hierarchical_bem"]
