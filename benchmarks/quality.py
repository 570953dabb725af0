"""Does routing earn its cost? BEM against PEFT LoRA and DoRA at an equal trainable-parameter budget.

    python benchmarks/quality.py [--suites multitask,control,recall,recall16, or "" for the curve alone] [--seeds 3]
        [--steps 400] [--rank 8] [--lr 3e-3] [--controller-lr-scale 1.0] [--base-width 256] [--base-layers 4]
        [--pretrain-steps 600] [--base-window 0] [--cache-dir DIR] [--device auto]
        [--plot-ranks 2,4,8,16,32] [--plot quality.png] [--json quality.json] [--jobs 1]

The frozen base is a byte-level Llama pretrained here on the installed packages' Python sources
(quality_base.py; cached in --cache-dir). On it, every variant trains the same steps on the same data stream
(per seed) with the same optimiser and schedule, and is scored on fresh sequences (quality_tasks.py):

- `bem`: routing on at --rank; `bem_static`: routing off at the rank whose trainable parameters come closest
  to `bem`'s; `lora` and `dora`: PEFT's adapters on the same linears at their closest ranks;
- transform suites (multitask, control): `bem-prefix`, `bem-chunk`, `bem-token`, `bem-gate`: `bem` with one
  routing level held at its initial, neutral value (its parameters frozen), to say which level carries a gain;
- recall suites (8 pairs and 4 queries; 16 pairs and 8 queries; `recall-far`, 8 pairs 64 bytes before their
  queries, for a base whose attention is a sliding window, `--base-window 8`): `bem+hyena`, `bem+mlstm`, a mixer
  after every block.

Scores: the multi-task and control suites, exact match of the whole answer (every answer token the argmax
under teacher forcing, which is what greedy decoding reproduces), per task and averaged; recall, per-query
accuracy. Mean and standard deviation over seeds; the table also gives each variant's trainable parameters,
its budget against `bem`'s, and the controller's share of `bem`'s parameters.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import statistics
import sys
import textwrap
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_base import BaseSpec, frozen_base  # noqa: E402
from quality_tasks import RecallSuite, TransformSuite, chance  # noqa: E402

from bem import HierarchicalBEMConfig, create_hierarchical_bem  # noqa: E402
from bem.io_utils import atomic_write_json  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ABLATIONS = {  # level -> the controller parameters that make it (their last layers start at zero)
    "prefix": ("prefix_head.",),
    "chunk": ("chunk_summary.", "chunk_head."),
    "token": ("token_head.",),
    "gate": ("gate.", "gate_log_temperature"),
}
SUITES = {
    "multitask": lambda: TransformSuite(),
    # one task that every variant learns part of within the steps (reverse and sort stay near zero for all, which
    # would hide any cost of routing)
    "control": lambda: TransformSuite(tasks=("running_max",)),
    "recall": lambda: RecallSuite(pairs=8, queries=4),
    "recall16": lambda: RecallSuite(pairs=16, queries=8),  # every key of the alphabet, twice the length
    # 64 filler bytes between the pairs and the queries: beyond what a base with --base-window 8 reaches through
    # 8 layers of windows (each layer's window adds to the reach)
    "recall-far": lambda: RecallSuite(pairs=8, queries=4, gap=64),
}


MIXER_HEADS = 4  # the mixers' heads (mLSTM's; --mixer-dim must be a multiple)


@dataclass
class Settings:
    steps: int = 400
    batch: int = 32
    lr: float = 3e-3
    eval_rows: int = 512
    rank: int = 8
    controller_dim: int = 32
    chunk_size: int = 4
    max_prefix_tokens: int = 4
    controller_lr_scale: float = 1.0  # the controller's learning rate over the adapters'
    mixer_dim: int = 64  # the mixers' inner width (recall suites)


def trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def linear_sizes(base: nn.Module) -> int:
    """Sum of (in + out) features over the targeted linears: a rank-1 adapter's parameters."""
    return sum(m.in_features + m.out_features for n, m in base.named_modules()
               if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS)


def output_sizes(base: nn.Module) -> int:
    return sum(m.out_features for n, m in base.named_modules()
               if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS)


def bem_config(settings: Settings, rank: int, routing: bool = True, mixer: Optional[str] = None,
               length: int = 64) -> HierarchicalBEMConfig:
    return HierarchicalBEMConfig(rank=rank, alpha=2.0 * rank, enable_routing=routing, attach_qkv=True,
                                 controller_dim=settings.controller_dim, chunk_size=settings.chunk_size,
                                 max_prefix_tokens=settings.max_prefix_tokens, use_fused_kernels=False,
                                 mixer=mixer, mixer_dim=settings.mixer_dim, mixer_heads=MIXER_HEADS,
                                 mixer_max_length=max(64, length))


def peft_adapter(base: nn.Module, rank: int, dora: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2.0 * rank, target_modules=TARGETS,
                                           lora_dropout=0.0, use_dora=dora))


def matched_rank(budget: int, per_rank: int, fixed: int = 0) -> int:
    """The rank whose parameter count (fixed + rank x per_rank) comes closest to `budget`."""
    return max(1, round((budget - fixed) / per_rank))


def variants(base_copy: Callable[[], nn.Module], settings: Settings, suite_name: str, rank: int,
             length: int) -> dict[str, Callable[[], nn.Module]]:
    """name -> builder of a freshly initialised variant (the base frozen inside)."""
    plain = base_copy()
    per_rank, outputs = linear_sizes(plain), output_sizes(plain)
    budget = trainable(create_hierarchical_bem(plain, bem_config(settings, rank, length=length)))
    static_rank = matched_rank(budget, per_rank)
    dora_rank = matched_rank(budget, per_rank, fixed=outputs)
    builders: dict[str, Callable[[], nn.Module]] = {
        "bem": lambda: create_hierarchical_bem(base_copy(), bem_config(settings, rank, length=length)),
        "bem_static": lambda: create_hierarchical_bem(base_copy(), bem_config(settings, static_rank, False,
                                                                              length=length)),
        "lora": lambda: peft_adapter(base_copy(), static_rank, dora=False),
        "dora": lambda: peft_adapter(base_copy(), dora_rank, dora=True),
    }
    for level, prefixes in ABLATIONS.items():
        builders[f"bem-{level}"] = lambda prefixes=prefixes: without_level(
            create_hierarchical_bem(base_copy(), bem_config(settings, rank, length=length)), prefixes)
    if is_recall(suite_name):
        for mixer in ("hyena", "mlstm"):
            builders[f"bem+{mixer}"] = lambda mixer=mixer: create_hierarchical_bem(
                base_copy(), bem_config(settings, rank, mixer=mixer, length=length))
    return builders


def without_level(model: nn.Module, prefixes: tuple[str, ...]) -> nn.Module:
    """Hold one routing level at its initial value: its parameters frozen (the heads' last layers are zero, so
    the level adds nothing; the gate stays at its initial, nearly open value)."""
    for name, param in model.controller.named_parameters():
        if name.startswith(prefixes):
            param.requires_grad_(False)
    return model


def labels_of(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, ids, torch.full_like(ids, -100))


def optimizer_for(model: nn.Module, settings: Settings) -> torch.optim.Optimizer:
    """AdamW at settings.lr, the routing controller's parameters (BEM's) at lr x controller_lr_scale."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    controller = [p for name, p in named if name.startswith("controller.")]
    groups = [{"params": [p for name, p in named if not name.startswith("controller.")], "lr": settings.lr}]
    if controller:
        groups.append({"params": controller, "lr": settings.lr * settings.controller_lr_scale})
    return torch.optim.AdamW(groups, weight_decay=0.0)


def train(model: nn.Module, suite, settings: Settings, seed: int, device: torch.device) -> list[float]:
    generator = torch.Generator().manual_seed(10_000 + seed)
    optimizer = optimizer_for(model, settings)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20)
                                                 * max(0.0, 1 - step / settings.steps))
    model.train()
    losses = []
    for step in range(settings.steps):
        ids, mask, _ = suite.batch(settings.batch, generator)
        ids, mask = ids.to(device), mask.to(device)
        loss = model(input_ids=ids, labels=labels_of(ids, mask)).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == settings.steps - 1:
            losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model: nn.Module, suite, settings: Settings, seed: int, device: torch.device) -> dict[str, float]:
    """Exact match per task (transform suites) or per-query accuracy (recall), on fresh rows."""
    generator = torch.Generator().manual_seed(20_000 + seed)
    ids, mask, which = suite.batch(settings.eval_rows, generator)
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids).logits
    predicted = logits[:, :-1].argmax(-1)
    target, answer = ids[:, 1:], mask[:, 1:]
    correct = (predicted == target) | ~answer
    if isinstance(suite, RecallSuite):
        return {"accuracy": ((predicted == target) & answer).sum().item() / answer.sum().item()}
    exact = correct.all(dim=1).float().cpu()
    scores = {task: exact[which == index].mean().item() for index, task in enumerate(suite.tasks)}
    scores["mean"] = statistics.fmean(scores.values())
    return scores


@dataclass(frozen=True)
class Job:
    """One training run: a variant of a suite at a rank, on one seed."""
    suite: str
    rank: int
    variant: str
    seed: int


def is_recall(suite_name: str) -> bool:
    return isinstance(SUITES[suite_name](), RecallSuite)


def variant_names(suite_name: str) -> list[str]:
    """The variants of a suite, in the table's order (the keys `variants` builds): the routing levels are ablated
    on the transform suites, the mixers added on the recall suites."""
    names = ["bem", "bem_static", "lora", "dora"]
    if is_recall(suite_name):
        return names + ["bem+hyena", "bem+mlstm"]
    return names + [f"bem-{level}" for level in ABLATIONS]


def run_job(base: nn.Module, job: Job, settings: Settings, device: torch.device) -> dict[str, Any]:
    """Train and score one variant on one seed: its scores, losses, seconds, trainable parameters and (for
    `bem`) the controller's share of them."""
    suite = SUITES[job.suite]()
    settings = replace(settings, rank=job.rank)
    builders = variants(lambda: copy.deepcopy(base), settings, job.suite, job.rank, suite.sequence_length)
    torch.manual_seed(job.seed)
    model = builders[job.variant]().to(device)
    params = trainable(model)
    controller = getattr(model, "controller", None)
    share = (sum(p.numel() for p in controller.parameters()) / params
             if controller is not None and job.variant == "bem" else None)
    started = time.perf_counter()
    losses = train(model, suite, settings, job.seed, device)
    scores = evaluate(model, suite, settings, job.seed, device)
    return {"seed": job.seed, "scores": scores, "losses": losses, "params": params, "share": share,
            "seconds": round(time.perf_counter() - started, 1)}


_WORKER: dict[str, Any] = {}  # a worker process's base and device, loaded once by `_start_worker`


def _start_worker(spec: BaseSpec, cache_dir: Optional[Path], device: str, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER["device"] = torch.device(device)
    _WORKER["base"] = frozen_base(spec, _WORKER["device"], cache_dir, lambda text: None)
    for param in _WORKER["base"].parameters():
        param.requires_grad_(False)


def _worker_job(job: Job, settings: Settings) -> dict[str, Any]:
    return run_job(_WORKER["base"], job, settings, _WORKER["device"])


def run_jobs(jobs: list[Job], base: nn.Module, settings: Settings, device: torch.device, workers: int,
             spec: BaseSpec, cache_dir: Optional[Path], threads: int) -> Iterator[tuple[Job, dict[str, Any]]]:
    """Each job's result as it finishes: in order in this process, or from `workers` processes of their own
    (each loads the base from `cache_dir`), which keeps a host-bound GPU busy with several runs at once."""
    if workers <= 1:
        for job in jobs:
            yield job, run_job(base, job, settings, device)
        return
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                             initargs=(spec, cache_dir, str(device), threads)) as pool:
        futures = {pool.submit(_worker_job, job, settings): job for job in jobs}
        try:
            for future in as_completed(futures):
                yield futures[future], future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


class Rows:
    """Turns finished runs into the table's rows (mean and std over seeds), each handed to `on_row` once all its
    seeds are in and every row before it was handed on, so rows keep the table's order whatever finishes first."""

    def __init__(self, jobs: list[Job], on_row: Callable[[dict[str, Any]], None]) -> None:
        self._seeds = Counter((job.suite, job.rank, job.variant) for job in jobs)  # runs a row waits for
        self._order = list(self._seeds)  # the jobs' order
        self._done: dict[tuple[str, int, str], list[dict[str, Any]]] = {key: [] for key in self._order}
        self._budgets: dict[tuple[str, int], int] = {}
        self._next = 0
        self._on_row = on_row

    def add(self, job: Job, result: dict[str, Any]) -> None:
        self._done[(job.suite, job.rank, job.variant)].append(result)
        while self._next < len(self._order) and len(self._done[self._order[self._next]]) == \
                self._seeds[self._order[self._next]]:
            self._on_row(self._row(self._order[self._next]))
            self._next += 1

    def _row(self, key: tuple[str, int, str]) -> dict[str, Any]:
        suite, rank, variant = key
        results = sorted(self._done[key], key=lambda r: r["seed"])
        params = results[0]["params"]
        if variant == "bem":
            self._budgets[(suite, rank)] = params
        budget = self._budgets.get((suite, rank))
        values = [r["scores"]["accuracy" if is_recall(suite) else "mean"] for r in results]
        seeds = [{k: r[k] for k in ("seed", "scores", "losses", "seconds")} for r in results]
        return {"suite": suite, "variant": variant, "rank": rank, "trainable": params,
                "budget": None if budget is None else params / budget, "controller_share": results[0]["share"],
                "mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "seeds": seeds}


def plot(points: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for variant in ("bem", "lora"):
        mine = sorted((p for p in points if p["variant"] == variant), key=lambda p: p["trainable"])
        axes.errorbar([p["trainable"] for p in mine], [p["mean"] for p in mine], yerr=[p["std"] for p in mine],
                      marker="o", capsize=3, label={"bem": "BEM (routed)", "lora": "PEFT LoRA"}[variant])
        for point in mine:
            axes.annotate(f"r{point['rank']}", (point["trainable"], point["mean"]), textcoords="offset points",
                          xytext=(4, -10), fontsize=7)
    axes.set_xscale("log")
    axes.set_xlabel("trainable parameters")
    axes.set_ylabel("multi-task exact match")
    axes.set_title(textwrap.fill(title, 90), fontsize=8)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def replot(report_path: Path, png: Path, parser: argparse.ArgumentParser) -> int:
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError) as error:
        parser.error(f"--replot: cannot read {report_path}: {error}")
    points = report.get("rank_curve") if isinstance(report, dict) else None
    if not points:
        parser.error(f"--replot: {report_path} has no rank curve (it was run without --plot-ranks)")
    plot(points, png, report.get("title", "") + ("" if report.get("complete") else " (cut off)"))
    print(f"wrote {png}")
    return 0


def table(rows: list[dict[str, Any]], seeds: int) -> str:
    lines = [f"| suite | variant | trainable params | budget vs bem | score (mean ± std, {seeds} seeds) |",
             "|---|---|---|---|---|"]
    for row in rows:
        budget = "-" if row["budget"] is None else f"{row['budget']:.3f}"
        share = "" if row["controller_share"] is None else f" (controller {100 * row['controller_share']:.1f}%)"
        lines.append(f"| {row['suite']} | {row['variant']} | {row['trainable']:,}{share} | {budget} | "
                     f"{row['mean']:.3f} ± {row['std']:.3f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", default="multitask,control,recall,recall16")
    parser.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--batch", type=int, default=Settings.batch)
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--controller-lr-scale", type=float, default=Settings.controller_lr_scale,
                        help="the routing controller's learning rate over the adapters' (BEM variants)")
    parser.add_argument("--rank", type=int, default=Settings.rank)
    parser.add_argument("--mixer-dim", type=int, default=Settings.mixer_dim,
                        help=f"the mixers' inner width on the recall suites (a multiple of their {MIXER_HEADS} heads)")
    parser.add_argument("--eval-rows", type=int, default=Settings.eval_rows)
    parser.add_argument("--base-width", type=int, default=BaseSpec.width)
    parser.add_argument("--base-layers", type=int, default=BaseSpec.layers)
    parser.add_argument("--pretrain-steps", type=int, default=BaseSpec.pretrain_steps)
    parser.add_argument("--base-window", type=int, default=BaseSpec.window,
                        help="the base's sliding attention window in tokens (a Mistral; default 0: full attention)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "bem" / "quality")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--plot-ranks", default="", help="e.g. 2,4,8,16,32: the score-against-parameters curve")
    parser.add_argument("--plot", type=Path, default=Path("quality.png"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--replot", type=Path, metavar="JSON",
                        help="draw the rank curve of a report written earlier (complete or cut off) to --plot; "
                             "nothing is trained")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: the cores over --jobs)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in a process of its own (a host-bound GPU takes several)")
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot, args.plot, parser)
    suites = [name for name in args.suites.split(",") if name]  # empty with --plot-ranks: the curve alone
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        parser.error(f"unknown suite {unknown[0]!r}; the suites are {', '.join(SUITES)}")
    if not suites and not args.plot_ranks:
        parser.error("--suites is empty and there is no --plot-ranks: nothing to run")
    if args.eval_rows < 48:  # the six tasks' rows are drawn at random: fewer could leave a task none to score
        parser.error(f"--eval-rows must be at least 48 (about 8 a task), got {args.eval_rows}")
    if not args.controller_lr_scale > 0:
        parser.error(f"--controller-lr-scale must be positive, got {args.controller_lr_scale}")
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.base_window < 0:
        parser.error(f"--base-window must be 0 (full attention) or positive, got {args.base_window}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.mixer_dim < MIXER_HEADS or args.mixer_dim % MIXER_HEADS:
        parser.error(f"--mixer-dim must be a positive multiple of the mixers' {MIXER_HEADS} heads, "
                     f"got {args.mixer_dim}")
    only = [v for v in args.variants.split(",") if v] or None
    known = {name for suite in suites or SUITES for name in variant_names(suite)}
    if only and set(only) - known:
        parser.error(f"unknown variant {sorted(set(only) - known)[0]!r} for these suites; "
                     f"the variants are {', '.join(sorted(known))}")
    try:
        ranks = [int(r) for r in args.plot_ranks.split(",") if r]
    except ValueError:
        parser.error(f"--plot-ranks must be comma-separated integers, got {args.plot_ranks!r}")
    if any(rank < 1 for rank in ranks):
        parser.error(f"--plot-ranks must be positive, got {args.plot_ranks!r}")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    torch.set_num_threads(threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    spec = BaseSpec(width=args.base_width, layers=args.base_layers, pretrain_steps=args.pretrain_steps,
                    window=args.base_window)
    base = frozen_base(spec, device, args.cache_dir, log)
    for param in base.parameters():
        param.requires_grad_(False)
    settings = Settings(steps=args.steps, batch=args.batch, lr=args.lr, rank=args.rank, eval_rows=args.eval_rows,
                        controller_lr_scale=args.controller_lr_scale, mixer_dim=args.mixer_dim)
    seeds = list(range(args.seeds))
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    kind = f"Mistral (attention window {spec.window})" if spec.window else "Llama"
    title = (f"{where}; base: byte-level {kind} {spec.width} wide, {spec.layers} layers, "
             f"{spec.pretrain_steps} pretraining steps; {settings.steps} steps, batch {settings.batch}, "
             f"lr {settings.lr}" + (f", controller x{settings.controller_lr_scale:g}"
                                    if settings.controller_lr_scale != 1.0 else ""))
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"title": title, "settings": vars(settings), "base": asdict(spec), "rows": rows,
                              "chance": {name: chance(SUITES[name]()) for name in SUITES}, "complete": False}

    def save(_: Any = None) -> None:  # after every variant: a run cut off keeps what it finished
        if args.json:
            atomic_write_json(args.json, report)

    jobs = [Job(name, settings.rank, variant, seed) for name in suites for variant in variant_names(name)
            if not only or variant in only for seed in seeds]
    jobs += [Job("multitask", rank, variant, seed) for rank in ranks for variant in ("bem", "lora")
             for seed in seeds]
    jobs = list(dict.fromkeys(jobs))  # a curve point at the suites' rank is the multitask row's run
    if ranks:
        report["rank_curve"] = []

    def on_row(row: dict[str, Any]) -> None:
        if row["suite"] in suites and row["rank"] == settings.rank and (not only or row["variant"] in only):
            rows.append(row)
        if row["rank"] in ranks and row["suite"] == "multitask" and row["variant"] in ("bem", "lora"):
            report["rank_curve"].append({k: row[k] for k in ("variant", "rank", "trainable", "mean", "std")})
        save()

    collected = Rows(jobs, on_row)
    for job, result in run_jobs(jobs, base, settings, device, args.jobs, spec, args.cache_dir, threads):
        log(f"  {job.suite} {job.variant}{f' rank {job.rank}' if job.rank != settings.rank else ''} seed {job.seed}: "
            f"{json.dumps({k: round(v, 3) for k, v in result['scores'].items()})} ({result['seconds']} s)")
        collected.add(job, result)
    if ranks:
        plot(report["rank_curve"], args.plot, title)
    report["complete"] = True
    save()
    print(title)
    print(table(rows, len(seeds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
