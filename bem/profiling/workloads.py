"""The measured workloads: prefill, cached decoding through `generate` (eager, or compiled on a static
cache), one training step.

Each builder returns a `Workload` (a callable taking the repeat index, used to rotate between a few
input batches) for one model; the same inputs are shared by every variant.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from ..training.optim import fused_on_cuda
from .timing import Workload

INPUT_SETS = 3  # distinct input batches rotated across repeats


def random_batches(vocab: int, batch: int, length: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    """Token ids away from the usual special ids (0..2), so no row is read as padding or end of text."""
    generator = torch.Generator().manual_seed(seed)
    low = 3 if vocab > 3 else 0
    return [torch.randint(low, vocab, (batch, length), generator=generator).to(device) for _ in range(INPUT_SETS)]


def prefill(model: nn.Module, batches: list[torch.Tensor], logits_to_keep: bool) -> Workload:
    """One forward over the prompt that builds the KV cache, as `generate` runs its first step."""
    extra = {"logits_to_keep": 1} if logits_to_keep else {}

    def run(index: int) -> Any:
        ids = batches[index % len(batches)]
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, **extra)

    return run


def supports_logits_to_keep(base_model: nn.Module) -> bool:
    """Whether the plain Hugging Face model can skip the logits of all but the last position."""
    try:
        return "logits_to_keep" in inspect.signature(base_model.forward).parameters
    except (TypeError, ValueError):
        return False


def generation(model: nn.Module, batches: list[torch.Tensor], new_tokens: int, pad_token_id: int,
               compile_backend: Optional[str] = None) -> Workload:
    """Greedy `generate` of exactly `new_tokens` tokens with the KV cache. With `compile_backend`: a static
    cache, whose decoding step generate compiles with that backend (on a CPU too, where generate would not)."""
    extra: dict[str, Any] = {}
    if compile_backend is not None:
        from transformers import CompileConfig

        compile_config = CompileConfig(backend=compile_backend)
        compile_config._compile_all_devices = True
        extra = {"cache_implementation": "static", "compile_config": compile_config}

    def run(index: int, **more: Any) -> Any:
        ids = batches[index % len(batches)]
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                              pad_token_id=pad_token_id, **extra, **more)

    return run


class StepTimes:
    """A logits processor that notes when each step's logits come out: a CUDA event on a GPU (recorded on the
    stream, so a step's time includes the device's idle time waiting for the host, as a user sees it), the host
    clock elsewhere."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return scores

    def step_ms(self) -> list[float]:
        """The gaps (ms) between successive steps' logits."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]

    def median_step_ms(self) -> float:
        return float(statistics.median(self.step_ms()))


def decoding_steps(model: nn.Module, batches: list[torch.Tensor], new_tokens: int, pad_token_id: int,
                   compile_backend: Optional[str] = None) -> Workload:
    """`generation` that returns its own measurement: the median over the decoding steps of one greedy `generate`
    of the time from one step's logits to the next's (ms per token). The prompt's prefill and generate's set-up
    fall outside every gap, so each repeat gives a per-token time from one call, where the difference of two whole
    calls gave one with the set-up's noise in it. `new_tokens` >= 2."""
    from transformers import LogitsProcessorList

    generate = generation(model, batches, new_tokens, pad_token_id, compile_backend)
    cuda = next(model.parameters()).is_cuda

    def run(index: int) -> float:
        timer = StepTimes(cuda)
        generate(index, logits_processor=LogitsProcessorList([timer]))
        return timer.median_step_ms()

    run.self_timed = True  # type: ignore[attr-defined]  # the timing loop records what it returns
    return run


def training_step(model: nn.Module, batches: list[torch.Tensor], learning_rate: float,
                  frozen_base: bool) -> Workload:
    """Forward + backward + AdamW step on the trainable parameters.

    The frozen base has nothing to train; its step is forward + backward with the gradient flowing to
    the input embeddings, the least any adapter's training step must do. AdamW is fused on CUDA, as
    `bem.training` and transformers' Trainer (its default `adamw_torch_fused`) make it.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = (torch.optim.AdamW(params, lr=learning_rate, **fused_on_cuda(params))
                 if params and not frozen_base else None)
    embeddings = model.get_input_embeddings()

    def run(index: int) -> None:
        ids = batches[index % len(batches)]
        if frozen_base:
            embeds = embeddings(ids).detach().requires_grad_(True)
            loss = model(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss
        else:
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def step_memory(model: nn.Module, step: Callable[[int], Any], device: torch.device) -> dict[str, Optional[int]]:
    """Memory of one training step: activation bytes saved for backward (any device; parameters not
    counted) and, on a GPU, the peak allocated above what was allocated before the step."""
    peak: Optional[int] = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with saved_storages(model) as seen:
        step(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device) - before)
    return {"saved_for_backward_bytes": int(sum(nbytes for _, _, nbytes in seen.values())), "peak_step_bytes": peak}


@contextlib.contextmanager
def saved_storages(model: nn.Module) -> Iterator[dict[int, tuple[torch.dtype, int, int]]]:
    """What autograd saves for the backward inside the block, the model's parameters left out: storage address ->
    (dtype, last dimension of a tensor saved from it, the storage's bytes). No tensor is held."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[torch.dtype, int, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address not in weights and (address not in seen or seen[address][2] < storage.nbytes()):
            seen[address] = (tensor.dtype, tensor.shape[-1] if tensor.dim() else 0, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield seen
