"""`run_profile`: measure base, BEM and LoRA on one model in one process and return the report."""

from __future__ import annotations

import platform
import time
import warnings
from typing import Any, Callable, Optional

import torch

from .config import ProfileConfig
from .models import Variants, build_variants, count_parameters, load_base_model, resolve_device, vocab_size
from .report import REPORT_KIND, SCHEMA_VERSION, apply_gate, make_setting
from .routing import capture_last_call, replay
from .statistics import bem_spread
from .stopping import StopRule
from .table import with_interval
from .timing import Clock, interleaved_until, median, warm_up_gpu
from . import workloads

Log = Callable[[str], None]
PerRepeat = Callable[[dict[str, list[float]]], dict[str, list[float]]]  # samples -> each variant's value per repeat


class Profiler:
    """Times the settings of one set of variants. With a `label` (a mixer setting), each setting's name
    carries it and no setting is gated."""

    def __init__(self, config: ProfileConfig, variants: Variants, device: torch.device, log: Log,
                 label: Optional[str] = None) -> None:
        self.config, self.variants, self.device, self.log = config, variants, device, log
        self.label = label
        self.clock = Clock(device)
        self.vocab = vocab_size(variants.base)
        self.pad_token_id = getattr(variants.base.config, "pad_token_id", None) or 0
        self.logits_to_keep = workloads.supports_logits_to_keep(variants.base)
        self.settings: list[dict[str, Any]] = []
        self.routing: list[dict[str, Any]] = []

    def _time(self, runs: dict, per_repeat: PerRepeat) -> tuple[dict[str, list[float]], str, float]:
        """Samples, why the repeats stopped, and the setting's wall time (warm-up and compiling included)."""
        timing = self.config.timing
        rule = StopRule(timing.min_repeats, timing.max_repeats, timing.target_spread, timing.max_seconds)
        started = time.perf_counter()
        samples, reason = interleaved_until(runs, self.clock, timing.warmup, rule,
                                            lambda s: bem_spread(per_repeat(s), timing.confidence))
        return samples, reason, time.perf_counter() - started

    def _variant_samples(self, samples: dict[str, list[float]]) -> dict[str, list[float]]:
        return {key: samples[key] for key in self.variants.named()}

    def _batches(self, batch: int, length: int, salt: int) -> list[torch.Tensor]:
        return workloads.random_batches(self.vocab, batch, length, self.config.seed + salt, self.device)

    # ------------------------------------------------------------------ prefill
    def _add_controller_run(self, runs: dict, method: str) -> None:
        """Time the controller alone on the exact call (`forward` or `step`) it gets inside BEM's run."""
        controller = self.variants.bem.controller
        if controller is not None:
            with capture_last_call(controller, method) as call:
                runs["bem"](0)
            runs["controller"] = replay(controller, method, call)

    def prefill(self, batch: int, length: int) -> None:
        name = f"prefill b{batch} s{length}"
        self.log(f"  {name}")
        batches = self._batches(batch, length, salt=batch * 100_003 + length)
        runs = {key: workloads.prefill(model, batches, self.logits_to_keep)
                for key, model in self.variants.named().items()}
        self._add_controller_run(runs, "forward")
        self._add(name, "prefill", {"batch": batch, "sequence": length}, "ms", runs, self._variant_samples)

    # ------------------------------------------------------------------ decode
    def decode(self, batch: int, compiled: bool = False) -> None:
        spec = self.config.decode
        name = f"decode (compiled) b{batch}" if compiled else f"decode b{batch}"
        backend = spec.compile_backend if compiled else None
        how = f", static cache, decoding step compiled ({backend})" if compiled else ""
        self.log(f"  {name} ({spec.new_tokens} tokens after a {spec.prompt_length}-token prompt{how})")
        batches = self._batches(batch, spec.prompt_length, salt=7_919 * batch)
        # each repeat: one generate per variant, its decoding steps timed one by one (the median step)
        runs = {key: workloads.decoding_steps(model, batches, spec.new_tokens, self.pad_token_id, backend)
                for key, model in self.variants.named().items()}
        if not compiled:  # compiled, the controller's step is part of one graph: no share to time apart
            self._add_controller_run(runs, "step")
        shape = {"batch": batch, "prompt_length": spec.prompt_length, "new_tokens": spec.new_tokens}
        kind = "decode_compiled" if compiled else "decode"
        self._add(name, kind, shape, "ms/token", runs, self._variant_samples)

    # ------------------------------------------------------------------ training step
    def train(self) -> None:
        spec = self.config.train
        name = f"train b{spec.batch_size} s{spec.sequence_length}"
        self.log(f"  {name}")
        batches = self._batches(spec.batch_size, spec.sequence_length, salt=31_337)
        models = self.variants.named()
        for model in models.values():
            model.train()
        try:
            runs = {key: workloads.training_step(model, batches, spec.learning_rate, frozen_base=(key == "base"))
                    for key, model in models.items()}
            shape = {"batch": spec.batch_size, "sequence": spec.sequence_length}
            self._add(name, "train", shape, "ms", runs, self._variant_samples,
                      memory=lambda: {key: workloads.step_memory(models[key], runs[key], self.device) for key in runs})
        finally:
            for model in models.values():
                model.eval()
                model.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ records
    def _add(self, name: str, kind: str, shape: dict, unit: str, runs: dict, per_repeat: PerRepeat,
             memory: Optional[Callable[[], dict]] = None) -> None:
        """Time `runs` until the stopping rule ends them, then record the setting (and the controller's share)."""
        samples, stop_reason, seconds = self._time(runs, per_repeat)
        values = per_repeat(samples)
        name = name if self.label is None else f"{name} [{self.label}]"
        gated = kind in self.config.gate and self.label is None
        setting = make_setting(name, kind, shape, unit, values, samples, memory() if memory else None,
                               gated=gated, confidence=self.config.timing.confidence,
                               stop_reason=stop_reason, seconds=seconds)
        self.settings.append(setting)
        # the ratio as soon as it is measured: a run cut off before its report is written keeps it in the log
        overhead = with_interval(setting["bem_overhead"], setting["intervals"].get("bem_overhead"))
        self.log(f"    {setting['repeats']} repeats ({stop_reason}, {seconds:.1f} s): BEM over base {overhead}")
        if "controller" in samples and setting["bem"] > 0 and setting["base"] > 0:
            controller_ms = median(samples["controller"])
            self.routing.append({
                "setting": name, "call": "forward" if kind == "prefill" else "step",
                "controller_ms": controller_ms, "samples": samples["controller"],
                "share_of_bem": controller_ms / setting["bem"],
                "fraction_of_base": controller_ms / setting["base"],
            })


def run_profile(config: ProfileConfig, log: Log = print) -> dict[str, Any]:
    """Measure every configured setting; the returned report is gated at `config.max_overhead`."""
    started = time.time()
    device = resolve_device(config.device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    log(f"loading the base model on {device} ...")
    base = load_base_model(config.model, device, config.seed)
    with warnings.catch_warnings():  # deprecation notices from the libraries' own calls are not ours to show
        warnings.simplefilter("ignore", FutureWarning)
        variants = build_variants(base, config.bem_config(), config.lora)
    warm_up_gpu(device, config.timing.gpu_warmup_seconds)
    profiler = Profiler(config, variants, device, log)
    log("measuring (base, BEM and LoRA interleaved; repeats until the spread or the budget says stop):")
    for batch, length in config.prefill.shapes:
        profiler.prefill(batch, length)
    for batch in config.decode.batch_sizes if config.decode.eager else []:
        profiler.decode(batch)
    if config.decode.compiled:
        for batch in config.decode.batch_sizes:
            profiler.decode(batch, compiled=True)
    if config.train.enabled:
        profiler.train()
    for kind in config.mixers:
        profiler.settings += mixer_settings(config, base, kind, device, log)
    kernels = None
    if config.kernels.run_with_profile:
        from .kernels import run_kernel_benchmark

        log("  kernel micro-benchmark")
        kernels = run_kernel_benchmark(config.kernels, device, repeats=config.timing.min_repeats, seed=config.seed)
    report = {
        "kind": REPORT_KIND,
        "schema_version": SCHEMA_VERSION,
        "name": config.name,
        "created_unix": started,
        "duration_s": time.time() - started,
        "config": config.to_dict(),
        "environment": environment(device, config),
        "model": model_summary(variants),
        "timing": timing_summary(config, profiler.clock, device),
        "settings": profiler.settings,
        "routing": profiler.routing,
        "kernels": kernels,
        "max_overhead": config.max_overhead,
        "failed": [],
        "undecided": [],
        "verdict": "undecided",
        "passed": False,
    }
    return apply_gate(report, config.max_overhead)


def mixer_settings(config: ProfileConfig, base: torch.nn.Module, kind: str, device: torch.device,
                   log: Log) -> list[dict[str, Any]]:
    """The prefill and eager decoding settings with BEM plus `kind` mixers in BEM's place (ungated rows)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        variants = build_variants(base, config.bem_config(mixer=kind), config.lora)
    label = f"+{kind}"
    log(f"measuring BEM {label}:")
    profiler = Profiler(config, variants, device, log, label=label)
    for batch, length in config.prefill.shapes:
        profiler.prefill(batch, length)
    for batch in config.decode.batch_sizes:
        profiler.decode(batch)
    del variants
    return profiler.settings


def timing_summary(config: ProfileConfig, clock: Clock, device: torch.device) -> dict[str, Any]:
    timing = config.timing
    return {"method": clock.method, "statistic": "median", "interval": "order-statistic interval of the median "
            "per-repeat ratio", "confidence": timing.confidence, "warmup": timing.warmup,
            "min_repeats": timing.min_repeats, "max_repeats": timing.max_repeats,
            "target_spread": timing.target_spread, "max_seconds": timing.max_seconds, "interleaved": True,
            "gpu_warmup_seconds": timing.gpu_warmup_seconds if device.type == "cuda" else 0.0}


def environment(device: torch.device, config: ProfileConfig) -> dict[str, Any]:
    import transformers

    from ..kernels import KERNELS_AVAILABLE

    try:
        import peft

        peft_version: Optional[str] = peft.__version__
    except ImportError:
        peft_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft_version,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "dtype": config.model.dtype,
        "attn_implementation": config.model.attn_implementation,
        "kernels_available": bool(KERNELS_AVAILABLE),
    }


def model_summary(variants: Variants) -> dict[str, Any]:
    bem = variants.bem
    return {
        "model_type": getattr(variants.base.config, "model_type", type(variants.base).__name__),
        "parameters": count_parameters(variants.base),
        "bem_modules": len(bem.bem_module_names),
        "bem_trainable_parameters": count_parameters(bem, trainable_only=True),
        "lora_trainable_parameters": (count_parameters(variants.lora, trainable_only=True)
                                      if variants.lora is not None else None),
        "lora_note": variants.lora_note,
        "routing": bem.controller is not None,
    }
