"""Where do two runs of the same two-GPU training part ways? Runs `bem train` (the multi-process test's
driver and settings) several times and logs, on every process after every optimizer step, exact checksums of
what the step left: the trainable weights each process holds (the controller, whole on every process, apart
from the sharded rest), their optimizer moments, and the step's loss. Then it prints, step by step, which
checksums differ between the rounds and between the processes.

    python scripts/fsdp_resume_probe.py --rounds 4 --strategy fsdp [--crash] [--save-every 4] [--out DIR]

--cpu: two CPU processes (gloo). --crash: process 1 dies after step 7, as in the test; otherwise every run goes to the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import test_training_multiprocess as multi  # noqa: E402

PROBE = """
import torch
from bem.training import trainer as _probe_trainer

_probe_step = _probe_trainer.Trainer._optimizer_step

def _exact(value):
    return float(value).hex()

def _probe_checksums(self, loss):
    from torch.distributed.tensor import DTensor
    controller = {id(p) for p in self.whole_params}
    sums = {"whole": torch.zeros((), dtype=torch.float64, device=self.accelerator.device),
            "sharded": torch.zeros((), dtype=torch.float64, device=self.accelerator.device),
            "exp_avg": torch.zeros((), dtype=torch.float64, device=self.accelerator.device),
            "exp_avg_sq": torch.zeros((), dtype=torch.float64, device=self.accelerator.device)}
    for param in self.params:
        local = param.to_local() if isinstance(param, DTensor) else param
        weights = torch.arange(1, local.numel() + 1, device=local.device, dtype=torch.float64)
        key = "whole" if id(param) in controller else "sharded"
        sums[key] += (local.detach().double().flatten() * weights).sum()
        state = self.optimizer.state.get(param, {})
        for moment in ("exp_avg", "exp_avg_sq"):
            if moment in state:
                value = state[moment]
                value = value.to_local() if isinstance(value, DTensor) else value
                sums[moment] += (value.double().flatten() * weights[:value.numel()]).sum()
    return {k: _exact(v) for k, v in sums.items()} | {"loss": _exact(loss)}

def _probe_optimizer_step(self, micro_batches):
    loss, counts = _probe_step(self, micro_batches)
    self._probe_steps = getattr(self, "_probe_steps", 0) + 1
    record = {"step": self._probe_steps, "rank": self.accelerator.process_index, **_probe_checksums(self, loss),
              **_probe_seen}
    with open(self.output_dir / f"probe_rank{self.accelerator.process_index}.jsonl", "a") as log:
        log.write(json.dumps(record) + "\\n")
    return loss, counts

_probe_trainer.Trainer._optimizer_step = _probe_optimizer_step

# the whole (controller) gradients before and after their all-reduce, and the clipping's total norm, each step
import torch.distributed as _probe_dist
from bem.training import distributed as _probe_distributed
_probe_average, _probe_clip = _probe_distributed.average_gradients, _probe_distributed.clip_grad_norm
_probe_seen = {}

def _grad_sum(params):
    grads = [p.grad.double().flatten() for p in params if p.grad is not None]
    if not grads:
        return "none"
    flat = torch.cat(grads)
    return _exact((flat * torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)).sum())

def _probe_average_gradients(params, world_size):
    _probe_seen["whole_grad_local"] = _grad_sum(params)
    if os.environ.get("PROBE_SYNC"):
        torch.cuda.synchronize()
        _probe_dist.barrier()
    _probe_average(params, world_size)
    if os.environ.get("PROBE_SYNC"):
        torch.cuda.synchronize()
    _probe_seen["whole_grad_averaged"] = _grad_sum(params)

def _probe_clip_grad_norm(params, max_norm):
    total = _probe_clip(params, max_norm)
    _probe_seen["clip_total"] = _exact(total)
    return total

_probe_distributed.average_gradients = _probe_average_gradients
_probe_distributed.clip_grad_norm = _probe_clip_grad_norm
"""


def run_round(root: Path, output_dir: Path, strategy: str, crash: bool, extra: list[str]) -> dict:
    done = multi.launch(root, output_dir, f"training.distributed={strategy}", *extra,
                        crash_after=multi.CRASH_AFTER if crash else 0)
    if (done.returncode != 0) != crash:
        print(done.stderr[-3000:])
    records = {}
    for rank in (0, 1):
        path = output_dir / f"probe_rank{rank}.jsonl"
        for line in (path.read_text().splitlines() if path.exists() else []):
            record = json.loads(line)
            records[(record["step"], rank)] = record
    return records


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--crash", action="store_true")
    parser.add_argument("--save-every", type=int, default=multi.SAVE_EVERY)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the test's)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cpu", action="store_true", help="two processes on the CPU (gloo) instead of two GPUs")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fsdp_probe_"))
    lines = (REPO / "data/tiny/train.jsonl").read_text().splitlines()[:40]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    driver = multi.DRIVER.replace("trainer_module.Trainer.train = train_and_write_each_adapter",
                                  PROBE + "\ntrainer_module.Trainer.train = train_and_write_each_adapter")
    (root / "driver.py").write_text(driver)
    extra = [f"training.save_every={args.save_every}", f"training.cpu={str(args.cpu).lower()}",
             *([f"training.max_steps={args.steps}"] if args.steps else [])]
    rounds = [run_round(root, root / f"round{i}", args.strategy, args.crash, extra) for i in range(args.rounds)]
    keys = ("loss", "whole_grad_local", "whole_grad_averaged", "clip_total", "whole", "sharded", "exp_avg",
            "exp_avg_sq")
    report = []
    steps = sorted({step for r in rounds for step, _ in r})
    print(f"{args.strategy}, crash={args.crash}, save_every={args.save_every}, {args.rounds} rounds")
    print("PROBE_SYNC" if os.environ.get("PROBE_SYNC") else "no extra synchronisation")
    print("step rank | " + " | ".join(keys) + "   (number of distinct values over the rounds)")
    for step in steps:
        for rank in (0, 1):
            values = [r.get((step, rank)) for r in rounds]
            present = [v for v in values if v is not None]
            distinct = {k: len({v.get(k) for v in present}) for k in keys}
            report.append({"step": step, "rank": rank, "distinct": distinct,
                           "values": [{k: v.get(k) for k in keys} if v else None for v in values]})
            print(f"{step:4d} {rank:4d} | " + " | ".join(f"{distinct[k]:>{len(k)}d}" for k in keys))
        for key in ("whole_grad_averaged", "whole"):
            same = [r.get((step, 0), {}).get(key) == r.get((step, 1), {}).get(key) for r in rounds]
            print(f"          {key} equal on both processes, round by round: {same}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        sync = "_sync" if os.environ.get("PROBE_SYNC") else ""
        name = f"probe_{args.strategy}_{'crash' if args.crash else 'full'}_save{args.save_every}{sync}.json"
        (args.out / name).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
