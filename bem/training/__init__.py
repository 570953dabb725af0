"""Fine-tuning with BEM from a YAML config: `bem train CONFIG.yaml`, `bem generate ADAPTER --prompt ...`.

    from bem.training import load_train_config, train

    config = load_train_config("configs/tiny.yaml", ["training.max_steps=20"])
    result = train(config)          # result.adapter_dir holds the adapter (save_pretrained format)
"""

from .config import TrainConfig, load_train_config
from .schema import ConfigError

__all__ = ["ConfigError", "TrainConfig", "load_train_config", "train"]


def train(config: TrainConfig, **kwargs):
    """See `bem.training.trainer.train` (imported lazily: it pulls in accelerate and transformers)."""
    from .trainer import train as _train

    return _train(config, **kwargs)
