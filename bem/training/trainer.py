"""The training loop: accelerate does devices, mixed precision and data parallelism; this file does the rest.

Loss normalisation: each optimizer step divides the summed token losses of all its micro-batches on all
processes by their total target-token count, so the update does not depend on how the global batch is
split over processes or accumulation steps (the two-process run matches the one-process run).
"""

from __future__ import annotations

import contextlib
import gc
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from ..io_utils import atomic_write_text
from . import checkpoint as ckpt
from . import distributed
from .config import TrainConfig
from .data import (IGNORE_INDEX, Collator, EpochSampler, read_records, split_examples, target_token_count,
                   tokenize_records)
from .metrics import MetricsLog, format_summary, routing_summary
from .model_factory import build_base_model, enable_gradient_checkpointing, load_tokenizer
from .optim import build_optimizer, build_scheduler, trainable_parameters
from .schema import ConfigError


@dataclass
class TrainResult:
    adapter_dir: Optional[Path]  # None when stopped early (stop_at_step)
    step: int
    last_loss: float
    eval_loss: Optional[float]
    is_main: bool = True  # the process that writes files and reports


def resolve_resume(config: TrainConfig) -> Optional[Path]:
    """The checkpoint to resume from, or None; refuses to start over a run's existing checkpoints."""
    resume, output_dir = config.training.resume, config.output_dir
    if resume is None:
        if ckpt.list_checkpoints(output_dir):
            raise ConfigError("training.resume", f"{output_dir} already holds checkpoints; set training.resume=latest "
                                                 f"to continue that run, or choose another training.output_dir")
        return None
    if resume == "latest":
        return ckpt.latest_checkpoint(output_dir)
    path = Path(resume)
    if not (path / ckpt.STATE_FILE).is_file():
        raise ConfigError("training.resume", f"{path} is not a complete checkpoint ({ckpt.STATE_FILE} is missing)")
    return path


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) over the positions whose label is not ignored."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


@contextlib.contextmanager
def frozen_collector() -> Iterator[None]:
    """Python's cyclic garbage collector with everything alive on entry (the libraries, the model, the optimizer)
    moved out of its reach until the exit. Its full collections walk every object: 181-260 ms in a 1B model's
    training process on a GPU, about one per 20 s of training, during which every process of the run waits
    for the stalled one; with the setup frozen, 9-17 ms. A process that froze objects itself is left as it is
    (unfreezing at the exit would unfreeze its objects too)."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


ADAPTER_SEED_OFFSET = 1  # the adapter's initial weights: seed training.seed + 1 (the base's draws use training.seed)


class Trainer:
    def __init__(self, config: TrainConfig, echo: Callable[[str], None] = print) -> None:
        from accelerate.utils import set_seed

        self.config = config
        training = config.training
        self.resume_from = resolve_resume(config)
        self.accelerator = distributed.make_accelerator(training)
        self.sharded = distributed.is_sharded(self.accelerator)  # FSDP: parameters are DTensor shards
        self.is_main = self.accelerator.is_main_process
        self.echo = echo if self.is_main else (lambda _msg: None)
        self.output_dir = config.output_dir
        self.base_dir = self.output_dir / "base_model"
        set_seed(training.seed)  # the same fresh base on every process (the adapter reseeds, _build_model)
        self._build_data()
        self._build_model()

    # ------------------------------------------------------------------ setup
    def _build_data(self) -> None:
        config = self.config
        saved_base = self.base_dir if config.model.path is None else None
        self.tokenizer = load_tokenizer(config.model, saved_base)
        train = tokenize_records(read_records(config.data.train, "data.train", config.data.dataset_split),
                                 self.tokenizer, config.data)
        if config.data.eval is not None:
            evaluation = tokenize_records(read_records(config.data.eval, "data.eval", config.data.dataset_split),
                                          self.tokenizer, config.data)
        else:
            train, evaluation = split_examples(train, config.data.eval_fraction, config.training.seed)
        self.train_examples, self.eval_examples = train, evaluation

    def _build_model(self) -> None:
        from accelerate.utils import set_seed

        from .. import create_hierarchical_bem

        config, training = self.config, self.config.training
        base = build_base_model(config.model, len(self.tokenizer), self.base_dir if config.model.path is None else None)
        if config.model.path is None and self.is_main and not (self.base_dir / "config.json").is_file():
            self._save_fresh_base(base)
        self.accelerator.wait_for_everyone()
        if config.model.quantization is not None and getattr(base, "hf_quantizer", None) is None:
            # a fresh base is saved in full precision (adapters load onto it quantized anew), then trained quantized
            base = build_base_model(config.model, len(self.tokenizer), self.base_dir, device=self.accelerator.device)
        if training.gradient_checkpointing:
            enable_gradient_checkpointing(base)
        bem_config = config.bem
        bem_config.base_model_name_or_path = config.model.path or str(self.base_dir)
        # The adapter's initial weights draw from a seed of their own, whatever the base took from the generator:
        # a fresh base is initialised at random, while a saved one loads without drawing, and the processes of one
        # run can differ in that (the others may find the base process 0 saved moments earlier). Under FSDP nothing
        # broadcasts one process's weights to the others, so they would train different adapters.
        set_seed(training.seed + ADAPTER_SEED_OFFSET)
        model = create_hierarchical_bem(base, bem_config)
        params = trainable_parameters(model)
        if training.mixed_precision != "no":
            # trainable weights stay fp32 under autocast; only the frozen base runs in the low precision
            for param in params:
                param.data = param.data.float()
        # under FSDP the controller stays whole on every process; its gradients are averaged by this loop
        self.whole_params = (distributed.keep_whole(self.accelerator, [model.controller])
                             if self.sharded and model.controller is not None else [])
        optimizer = build_optimizer(params, training, apart=self.whole_params, device=self.accelerator.device)
        self.sampler = EpochSampler(len(self.train_examples), training.seed)
        loader = torch.utils.data.DataLoader(self.train_examples, batch_size=training.batch_size, sampler=self.sampler,
                                             drop_last=True, collate_fn=Collator(self.tokenizer.pad_token_id),
                                             pin_memory=self.accelerator.device.type == "cuda")
        self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)
        accumulation = training.gradient_accumulation_steps
        self.micro_per_epoch = len(self.loader) // accumulation * accumulation
        if self.micro_per_epoch == 0:
            raise ConfigError("training.batch_size", f"{len(self.train_examples)} training examples do not fill one "
                                                     f"optimizer step of batch_size {training.batch_size} x "
                                                     f"gradient_accumulation_steps {accumulation} x "
                                                     f"{self.accelerator.num_processes} processes")
        self.steps_per_epoch = self.micro_per_epoch // accumulation
        self.total_steps = training.max_steps or training.epochs * self.steps_per_epoch
        # stepped once per optimizer step by this loop (accelerate's wrapper would step it per process)
        self.scheduler = build_scheduler(optimizer, training, self.total_steps)
        self.params = trainable_parameters(self.model)  # FSDP replaced them with sharded ones

    def _save_fresh_base(self, base: torch.nn.Module) -> None:
        # the adapter is only usable with these exact random weights: keep them, written atomically
        tmp = self.output_dir / ".tmp-base_model"
        if tmp.exists():
            shutil.rmtree(tmp)
        base.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        tmp.replace(self.base_dir)

    @property
    def bem_model(self):
        return self.accelerator.unwrap_model(self.model)

    # ------------------------------------------------------------------ checkpoints
    def _state(self, step: int, tokens_seen: int) -> ckpt.TrainerState:
        consumed = step * self.config.training.gradient_accumulation_steps
        return ckpt.TrainerState(step=step, epoch=consumed // self.micro_per_epoch,
                                 micro_batch_in_epoch=consumed % self.micro_per_epoch, tokens_seen=tokens_seen,
                                 world_size=self.accelerator.num_processes, batch_size=self.config.training.batch_size,
                                 gradient_accumulation_steps=self.config.training.gradient_accumulation_steps,
                                 distributed="fsdp" if self.sharded else "ddp")

    def full_adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's full tensors on every process (under FSDP a collective: all processes call it)."""
        return distributed.full_tensors(self.bem_model.bem_state_dict())

    def save_checkpoint(self, step: int, tokens_seen: int) -> Path:
        scheduler_state = {"scheduler": self.scheduler.state_dict()}
        if self.accelerator.scaler is not None:
            scheduler_state["grad_scaler"] = self.accelerator.scaler.state_dict()
        adapter_state = self.full_adapter_state() if self.sharded or self.is_main else None
        optimizer_state, sharded = None, []
        if self.sharded:  # each process saves its own shard of the optimizer state
            optimizer_state, sharded = distributed.local_shards(self.optimizer.state_dict())
        elif self.is_main:
            optimizer_state = self.optimizer.state_dict()
        return ckpt.save_checkpoint(
            self.output_dir, self._state(step, tokens_seen), adapter_state=adapter_state if self.is_main else None,
            optimizer_state=optimizer_state, scheduler_state=scheduler_state, rank=self.accelerator.process_index,
            is_main=self.is_main, barrier=self.accelerator.wait_for_everyone,
            keep=self.config.training.save_total_limit, sharded=sharded)

    def _restore(self, directory: Path) -> ckpt.TrainerState:
        ckpt.check_resumable(ckpt.read_trainer_state(directory), self._state(0, 0), directory)
        state, adapter, optimizer_state, sharded, scheduler_state = ckpt.load_checkpoint(
            directory, self.accelerator.process_index)
        # copy_ casts to each weight's device and dtype; under FSDP each process keeps its shard of the file's tensors
        self.bem_model.load_bem_state_dict(distributed.sharded_like(adapter, self.bem_model.bem_state_dict()))
        ckpt.check_param_groups(optimizer_state["param_groups"], self.optimizer.param_groups, directory)
        if sharded:
            optimizer_state = distributed.reshard_optimizer_state(
                optimizer_state, sharded, distributed.optimizer_parameters(self.optimizer))
        self.optimizer.load_state_dict(optimizer_state)
        self.scheduler.load_state_dict(scheduler_state["scheduler"])
        if self.accelerator.scaler is not None and "grad_scaler" in scheduler_state:
            self.accelerator.scaler.load_state_dict(scheduler_state["grad_scaler"])
        return state

    # ------------------------------------------------------------------ batches
    def _micro_batches(self, state: ckpt.TrainerState) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches from the checkpoint's position on, epoch after epoch, in a fixed order."""
        epoch, skip = state.epoch, state.micro_batch_in_epoch
        while True:
            loader = self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
            self.sampler.set_epoch(epoch)
            loader.set_epoch(epoch)  # the loader re-applies its epoch to the sampler when iterated
            for index, batch in enumerate(loader, start=skip):
                if index >= self.micro_per_epoch:
                    break  # the incomplete accumulation group at an epoch's end is left out
                yield batch
            epoch, skip = epoch + 1, 0

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        if not self.eval_examples:
            return None
        # each process scores every world_size-th example: exact sums, no padded duplicates
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        shard = self.eval_examples[rank::world]
        batch_size = self.config.training.eval_batch_size or self.config.training.batch_size
        collate = Collator(self.tokenizer.pad_token_id)
        totals = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)
        batches = -(-len(shard) // batch_size)
        if self.sharded:
            # FSDP gathers each block's weights in every forward, a collective: each process runs as many
            # forwards as rank 0, which has the most examples, the missing ones on a batch that is not counted
            batches = -(-len(self.eval_examples[0::world]) // batch_size)
        if self.sharded:
            distributed.forget_kept_transposes(self.bem_model)
        self.model.eval()
        for index in range(batches):
            examples = shard[index * batch_size:(index + 1) * batch_size]
            batch = collate(examples or self.eval_examples[:1])
            batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
            with self.accelerator.autocast():
                logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            if examples:
                totals[0] += token_loss_sum(logits, batch["labels"]).double()
                totals[1] += target_token_count(batch["labels"])
        self.model.train()
        totals = self.accelerator.reduce(totals, "sum")
        loss = float(totals[0] / totals[1].clamp_min(1))
        result = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
        if self.config.logging.routing_summary and shard:
            result.update(routing_summary(self.bem_model.routing_stats()))
        return result

    # ------------------------------------------------------------------ the loop
    def train(self, stop_at_step: Optional[int] = None) -> TrainResult:
        """Train to the configured end; `stop_at_step` ends early without the final save (an interruption)."""
        with frozen_collector():
            return self._train(stop_at_step)

    def _train(self, stop_at_step: Optional[int]) -> TrainResult:
        config, training = self.config, self.config.training
        accelerator = self.accelerator
        state = self._state(0, 0)
        if self.resume_from is not None:
            state = self._restore(self.resume_from)
            self.echo(f"resuming from {self.resume_from} at step {state.step}")
        elif training.resume == "latest":
            self.echo(f"no checkpoint in {self.output_dir / 'checkpoints'}; starting from scratch")
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.output_dir / "config.yaml", config.to_yaml())
        metrics = self._metrics_log(state.step if self.resume_from is not None else None)
        if self.is_main and state.step == 0:
            trainable, total = self.bem_model.get_nb_trainable_parameters()
            self.echo(f"trainable params: {trainable:,d} || all params: {total:,d} || "
                      f"trainable%: {100 * trainable / max(total, 1):.4f}")
            self.echo(f"{len(self.train_examples)} training examples, {len(self.eval_examples)} eval examples; "
                      f"{self.steps_per_epoch} steps per epoch, {self.total_steps} steps")
        progress = self._progress(state.step)
        step, tokens_seen = state.step, state.tokens_seen
        batches = self._micro_batches(state)
        loss_value, eval_result = float("nan"), None
        window_start, window_tokens = time.perf_counter(), 0
        # a step's loss and token counts stay on the device until a log or a checkpoint needs them: a step ends
        # without waiting for the device, and the host queues the next one meanwhile (under FSDP the host's share
        # of a step is large)
        loss, pending = None, None
        self.model.train()
        while step < self.total_steps and (stop_at_step is None or step < stop_at_step):
            loss, counts = self._optimizer_step([next(batches) for _ in range(training.gradient_accumulation_steps)])
            step += 1
            pending = counts if pending is None else pending + counts
            final = step == self.total_steps
            logging_now = step % training.log_every == 0 or final
            saving = bool(training.save_every and step % training.save_every == 0) or final
            if logging_now or saving:
                target_tokens, input_tokens = (int(x) for x in pending.tolist())
                tokens_seen, window_tokens, pending = tokens_seen + target_tokens, window_tokens + input_tokens, None
                loss_value = float(loss)
            if logging_now:
                elapsed = max(time.perf_counter() - window_start, 1e-9)
                record = {"step": step, "loss": loss_value, "lr": self.scheduler.get_last_lr()[0],
                          "tokens_per_s": window_tokens / elapsed, "tokens_seen": tokens_seen,
                          "epoch": step / self.steps_per_epoch, **self._peak_memory()}
                if self.is_main:
                    metrics.write(record)
                    if progress is not None:
                        progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{record['lr']:.2e}",
                                             tok_s=f"{record['tokens_per_s']:.0f}")
                window_start, window_tokens = time.perf_counter(), 0
            if progress is not None:
                progress.update(1)
            if (training.eval_every and step % training.eval_every == 0) or final:
                eval_result = self.evaluate()
                if eval_result is not None and self.is_main:
                    metrics.write({"step": step, **eval_result})
                    self._write(f"step {step}: {format_summary(eval_result)}", progress)
            if saving:
                path = self.save_checkpoint(step, tokens_seen)
                self._write(f"saved checkpoint {path}", progress)
        if progress is not None:
            progress.close()
        metrics.close()
        if loss is not None:
            loss_value = float(loss)
        if step < self.total_steps:
            return TrainResult(None, step, loss_value, None, self.is_main)
        adapter_dir = self.output_dir / "adapter"
        if self.sharded:
            # a normal adapter of full tensors, loadable on one process
            full = self.full_adapter_state()
            if self.is_main:
                with distributed.adapter_state_override(self.bem_model, full):
                    self.bem_model.save_pretrained(adapter_dir)
        elif self.is_main:
            self.bem_model.save_pretrained(adapter_dir)
        accelerator.wait_for_everyone()
        self.echo(f"adapter saved to {adapter_dir}")
        return TrainResult(adapter_dir, step, loss_value, None if eval_result is None else eval_result["eval_loss"],
                           self.is_main)

    def _optimizer_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `micro_batches`; returns the global mean loss and the (target, input) token
        counts, as device tensors (reading them waits for the step)."""
        accelerator = self.accelerator
        local = torch.stack([sum(target_token_count(b["labels"]) for b in micro_batches),
                             sum(b["attention_mask"].sum() for b in micro_batches)]).to(accelerator.device)
        counts = accelerator.reduce(local, "sum")
        # DDP averages gradients over processes; scaling by the process count turns that into a global sum
        scale = accelerator.num_processes / counts[0].clamp_min(1).float()
        loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(self.model):
                # autocast here as well: under FSDP accelerate does not wrap the forward in it
                with accelerator.autocast():
                    logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                summed = token_loss_sum(logits, batch["labels"])
                accelerator.backward(summed * scale)
            loss_sum += summed.detach().double()
        if self.whole_params:  # what FSDP leaves whole, it does not reduce either
            distributed.average_gradients(self.whole_params, accelerator.num_processes)
        if self.config.training.max_grad_norm is not None:
            if self.sharded:
                distributed.clip_grad_norm(self.params, self.config.training.max_grad_norm)
            else:
                accelerator.clip_grad_norm_(self.params, self.config.training.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return accelerator.reduce(loss_sum, "sum") / counts[0].clamp_min(1), counts

    # ------------------------------------------------------------------ output
    def _peak_memory(self) -> dict[str, Any]:
        """Each process's peak GPU memory so far, in GiB (a gather: every process calls it); nothing on CPU."""
        device = self.accelerator.device
        if device.type != "cuda":
            return {}
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
        by_rank = [float(x) for x in self.accelerator.gather(peak).tolist()]
        return {"peak_memory_gib": max(by_rank), "peak_memory_gib_by_rank": by_rank}

    def _metrics_log(self, resume_step: Optional[int]) -> MetricsLog:
        if not self.is_main:
            return MetricsLog(None, None, None)
        logging = self.config.logging
        path = self.output_dir / logging.metrics_file if logging.metrics_file else None
        tensorboard = self.output_dir / "tensorboard" if logging.tensorboard else None
        return MetricsLog(path, tensorboard, resume_step)

    def _progress(self, initial: int):
        if not (self.is_main and self.config.logging.console):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=initial, desc="training", unit="step", dynamic_ncols=True)

    def _write(self, message: str, progress: Any) -> None:
        if not self.is_main:
            return
        if progress is not None:
            progress.write(message)
        else:
            self.echo(message)


def train(config: TrainConfig, stop_at_step: Optional[int] = None, echo: Callable[[str], None] = print) -> TrainResult:
    """Fine-tune with BEM as `config` says; see `docs/training.md`."""
    return Trainer(config, echo=echo).train(stop_at_step=stop_at_step)
