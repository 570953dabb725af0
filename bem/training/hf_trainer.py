"""transformers' Trainer for a BEMModel, whose checkpoints hold the adapter as a PEFT model's do.

    from bem.training.hf_trainer import BEMTrainer

    trainer = BEMTrainer(model=bem_model, args=TrainingArguments(...), train_dataset=data)

The plain Trainer saves a model that is neither a `PreTrainedModel` nor a `PeftModel` as its whole state
dict: the frozen base again in every checkpoint, and refused by safetensors where the base ties its input
and output embeddings (GPT-2 and many small causal LMs). `BEMTrainerMixin` saves the adapter instead
(`save_pretrained`'s two files) and loads it back, so `resume_from_checkpoint`, `load_best_model_at_end`
and `BEMModel.from_pretrained(base, "out/checkpoint-500")` all work. It mixes into any Trainer subclass:
`class MyTrainer(BEMTrainerMixin, SomeTrainer)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from torch import nn
from transformers import Trainer

from ..model import BEMModel
from ..persistence import CONFIG_NAME, load_adapter_weights


def _is_adapter_dir(path: Optional[str]) -> bool:
    return path is not None and (Path(path) / CONFIG_NAME).is_file()


class BEMTrainerMixin:
    """Trainer methods that save and load a BEMModel's adapter; any other model takes the Trainer's own."""

    def _bem_model(self) -> Optional[BEMModel]:
        model = self.accelerator.unwrap_model(self.model)  # type: ignore[attr-defined]
        return model if isinstance(model, BEMModel) else None

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        model = self._bem_model()
        if model is None:
            return super()._save(output_dir, state_dict)  # type: ignore[misc]
        if not self.args.should_save:  # type: ignore[attr-defined]
            return None
        output_dir = output_dir if output_dir is not None else self.args.output_dir  # type: ignore[attr-defined]
        model.save_pretrained(output_dir)
        if getattr(self, "processing_class", None) is not None:
            self.processing_class.save_pretrained(output_dir)  # type: ignore[attr-defined]
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        target = model if model is not None else self.model  # type: ignore[attr-defined]
        if isinstance(target, BEMModel) and _is_adapter_dir(resume_from_checkpoint):
            load_adapter_weights(target, Path(resume_from_checkpoint))
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_best_model(self) -> None:
        model = self._bem_model()
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        if model is not None and _is_adapter_dir(best):
            load_adapter_weights(model, Path(best))
            return None
        return super()._load_best_model()  # type: ignore[misc]


class BEMTrainer(BEMTrainerMixin, Trainer):
    """`transformers.Trainer` whose checkpoints of a BEMModel hold its adapter (see the module's notes)."""
