"""How many `generate` calls compiled decoding takes to reach its steady speed, base against BEM, on a GPU.

    PYTHONPATH=. [TORCH_LOGS=cudagraphs,recompiles] python scripts/compiled_warmup_probe.py \
        --config configs/profile_phi3_mini.yaml --batch 16 --calls 12 [--order interleaved|separate] [--device cpu]

The sweep's compiled rows time `generate` with a static cache (generate compiles the decoding step, inductor with
CUDA graphs). Some of BEM's repeats there ran about 3x slower per token than the rest (Phi-3-mini b16: 26 ms a
token in every repeat of one run, 32 ms in the first three of another, then 8.7), as if the step ran without its
CUDA graph. This runs the sweep's own workload (`bem.profiling.workloads.generation`) `--calls` times per
variant, each followed by its 1-token generate (the sweep's per-token time is the difference over the new tokens
less one), interleaved as the sweep runs them or one variant after the other, and prints each call's
milliseconds, its per-token time, how many forwards generate sent through its compiled call and how many
through the plain one, and what dynamo's and inductor's counters gained during the two calls.
`--device cpu` (the eager backend, no CUDA graphs) only checks that the script runs.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch._dynamo.utils import counters

from bem.model import BEMModel
from bem.profiling.config import load_profile_config
from bem.profiling.models import build_variants, load_base_model
from bem.profiling.timing import Clock
from bem.profiling.workloads import generation


def snapshot() -> dict[str, int]:
    return {f"{group}.{key}": value for group in ("inductor", "stats") for key, value in counters[group].items()}


def count_forwards(model: torch.nn.Module, tally: dict[str, int]) -> None:
    """Count the forwards generate sends through `get_compiled_call`'s callable ("compiled") and the rest,
    on the transformers model (a BEM model's generate runs its base model's)."""
    model = model.base_model if isinstance(model, BEMModel) else model
    get_compiled_call = model.get_compiled_call

    def counted(compile_config):
        compiled = get_compiled_call(compile_config)

        def call(*args, **kwargs):
            tally["compiled"] += 1
            return compiled(*args, **kwargs)
        return call

    model.get_compiled_call = counted
    model.register_forward_pre_hook(lambda *_: tally.__setitem__("forwards", tally["forwards"] + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--order", choices=("interleaved", "separate"), default="interleaved")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    config = load_profile_config(args.config)
    device = torch.device(args.device)
    backend = "inductor" if device.type == "cuda" else "eager"
    base = load_base_model(config.model, device, config.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        variants = build_variants(base, config.bem_config(), with_lora=False)
    torch.manual_seed(config.seed)
    prompt, new = config.decode.prompt_length, config.decode.new_tokens
    batches = [torch.randint(3, base.config.vocab_size, (args.batch, prompt), device=device) for _ in range(3)]
    models = (("base", variants.base), ("bem", variants.bem))
    tallies = {name: {"compiled": 0, "forwards": 0} for name, _ in models}
    for name, model in models:
        count_forwards(model, tallies[name])
    runs = {name: (generation(model, batches, new, 0, compile_backend=backend),
                   generation(model, batches, 1, 0, compile_backend=backend)) for name, model in models}
    order = ([(i, name) for i in range(args.calls) for name in runs] if args.order == "interleaved"
             else [(i, name) for name in runs for i in range(args.calls)])
    clock = Clock(device)  # as the sweep times (CUDA events on a GPU)
    for i, name in order:
        before = snapshot()
        tally_before = dict(tallies[name])
        full, first = (clock.time_ms(lambda: run(i)) for run in runs[name])
        gained = {k: v - before.get(k, 0) for k, v in snapshot().items() if v != before.get(k, 0)}
        forwards = {k: tallies[name][k] - tally_before[k] for k in tally_before}
        print(f"{name:<5} call {i:>2}: {full:8.1f} ms ({first:6.1f} for one token), "
              f"{(full - first) / (new - 1):6.2f} ms a token, forwards {forwards['forwards']} "
              f"({forwards['compiled']} compiled)  {gained}", flush=True)


if __name__ == "__main__":
    main()
