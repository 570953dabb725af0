"""Adapter checkpoints for a BEMModel trained with transformers' Trainer.

    trainer = Trainer(model=bem_model, args=args, train_dataset=data, callbacks=[SaveBEMAdapterCallback()])

The Trainer checkpoints a model that is not a `PreTrainedModel` as its whole state dict; this callback
adds the adapter (`save_pretrained`) to each checkpoint folder, so that
`BEMModel.from_pretrained(base, "out/checkpoint-500")` loads it, as a PEFT checkpoint folder loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR


class SaveBEMAdapterCallback(TrainerCallback):
    """After each Trainer save, write the BEM adapter into that checkpoint's folder (main process only)."""

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                model: Any = None, **kwargs: Any) -> None:
        from ..model import BEMModel

        if not state.is_world_process_zero:
            return
        if not isinstance(model, BEMModel):
            raise TypeError(f"SaveBEMAdapterCallback saves a BEMModel, but the Trainer's model is a "
                            f"{type(model).__name__}")
        model.save_pretrained(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
