"""Two processes on CPU (gloo), launched as users launch them (`accelerate launch`), with DDP and with FSDP2.
Each strategy runs once: the run loses a process after step 7, and is resumed from its last checkpoint
(step 4) to the end. Then:

- the resumed run repeats the steps the crash lost (5 and 6) bit for bit;
- the whole run matches a one-process run over the same global batch (losses and adapter);
- both processes end with the same adapter, and the saved adapter is the full one, loadable on one process;
- under FSDP every process checkpoints its own shard of the optimizer state.

The runs train every kind of adapter weight (V and U, the controller, a `modules_to_save` copy of lm_head)
with gradient accumulation and gradient checkpointing, over two epochs of a small data set.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bem.training import load_train_config
from bem.training.trainer import train

REPO = Path(__file__).resolve().parent.parent
STEPS, SAVE_EVERY, CRASH_AFTER = 8, 4, 7

# `bem train` (what `-m bem train` runs), which also writes each process's full adapter at the end and how
# much of the model's parameters the process holds; with CRASH_AFTER_STEP set, process 1 kills itself after
# that step, as a crash would, and the launcher ends the run
DRIVER = """
import json, os, signal, sys
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from bem.training import trainer as trainer_module
from bem.training.cli import train_main

run_to_the_end = trainer_module.Trainer.train
crash_after = int(os.environ.get("CRASH_AFTER_STEP", "0"))

def train_and_write_each_adapter(self, stop_at_step=None):
    rank = self.accelerator.process_index
    if crash_after and rank == 1:
        run_to_the_end(self, stop_at_step=crash_after)
        os.kill(os.getpid(), signal.SIGKILL)
    result = run_to_the_end(self, stop_at_step=stop_at_step)
    full = {key: value.contiguous() for key, value in self.full_adapter_state().items()}
    save_file(full, str(self.output_dir / f"rank{rank}.safetensors"))
    params = list(self.model.parameters())
    held = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    groups = [{isinstance(p, DTensor) for p in group["params"]} for group in self.optimizer.param_groups]
    record = {"numel": sum(p.numel() for p in params), "held": sum(p.numel() for p in held),
              "frozen_sharded": all(isinstance(p, DTensor) for p in params if not p.requires_grad),
              "groups_mix_sharded_and_whole": any(len(kinds) > 1 for kinds in groups),
              "accelerate_fsdp2": bool(self.accelerator.is_fsdp2)}
    (self.output_dir / f"rank{rank}.json").write_text(json.dumps(record))
    return result

trainer_module.Trainer.train = train_and_write_each_adapter
sys.exit(train_main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def python_path() -> str:
    """The driver runs from a temporary folder: it finds this checkout's bem whether or not it is installed."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def overrides(data: Path, output_dir: Path, processes: int, *extra: str) -> list[str]:
    # global batch 8 either way: 1 process x 8, or 2 processes x 2 x 2 accumulation steps
    shape = ["training.batch_size=8"] if processes == 1 else ["training.batch_size=2",
                                                             "training.gradient_accumulation_steps=2"]
    return [f"data.train={data}", "data.eval=null", "data.eval_fraction=0.1", f"training.output_dir={output_dir}",
            f"training.max_steps={STEPS}", f"training.save_every={SAVE_EVERY}", "training.save_total_limit=null",
            "training.log_every=1", "training.gradient_checkpointing=true", "bem.modules_to_save=[lm_head]",
            "logging.console=false", *shape, *extra]


def launch(root: Path, output_dir: Path, *extra: str, crash_after: int = 0) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes 2` of the driver: two processes (the config's
    training.cpu keeps them on the CPU, where --multi_gpu only means several processes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(root / "hf_home"),  # no accelerate config of the user's
           "CRASH_AFTER_STEP": str(crash_after), "PYTHONPATH": python_path()}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(root / "driver.py"), str(REPO / "configs/tiny.yaml"),
               *overrides(root / "train.jsonl", output_dir, 2, *extra)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def side_by_side(root: Path, runs: dict[str, Path], *extra: str,
                 crash_after: int = 0) -> dict[str, subprocess.CompletedProcess]:
    """`launch` for each strategy -> output dir of `runs` at once: each spends much of its time starting up."""
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {strategy: pool.submit(launch, root, output_dir, f"training.distributed={strategy}", *extra,
                                         crash_after=crash_after) for strategy, output_dir in runs.items()}
        return {strategy: future.result() for strategy, future in futures.items()}


def crash_then_resume(root: Path, runs: dict[str, Path], *extra: str) -> None:
    """For each strategy -> output dir of `runs`: a run that loses process 1 after step 7 (its last checkpoint
    is step 4), then resumes to the end. What the interrupted run logged and left is kept beside it."""
    for strategy, crashed in side_by_side(root, runs, *extra, crash_after=CRASH_AFTER).items():
        output_dir = runs[strategy]
        assert crashed.returncode != 0, f"{strategy}: the run was meant to lose process 1 after step {CRASH_AFTER}"
        (output_dir / "crashed_metrics.jsonl").write_text((output_dir / "metrics.jsonl").read_text())
        left = sorted(p.name for p in (output_dir / "checkpoints").iterdir())
        left += ["adapter"] if (output_dir / "adapter").exists() else []
        (output_dir / "crashed_left.json").write_text(json.dumps(left))
    for strategy, resumed in side_by_side(root, runs, *extra, "training.resume=latest").items():
        assert resumed.returncode == 0, f"{strategy}: {resumed.stderr[-4000:]}"
        assert f"resuming from {runs[strategy] / 'checkpoints' / f'step-{SAVE_EVERY:08d}'}" in resumed.stdout


def losses(output_dir: Path, name: str = "metrics.jsonl") -> list[tuple[int, str, float]]:
    records = [json.loads(line) for line in (output_dir / name).read_text().splitlines()]
    return [(r["step"], key, r[key]) for r in records for key in ("loss", "eval_loss") if key in r]


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors") if path.is_dir() else str(path))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def make_root(tmp_path_factory, name: str) -> Path:
    """A folder with the runs' data (40 rows of the tiny data set) and the driver."""
    root = tmp_path_factory.mktemp(name)
    lines = (REPO / "data/tiny/train.jsonl").read_text().splitlines()[:40]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "driver.py").write_text(DRIVER)
    return root


def train_one_process(root: Path, *extra: str) -> Path:
    """The same run in this process, with the two-process runs' global batch; its output folder."""
    output_dir = root / "one"
    config = load_train_config(REPO / "configs/tiny.yaml", overrides(root / "train.jsonl", output_dir, 1, *extra))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train(config, echo=lambda _: None).step == STEPS
    finally:
        torch.set_num_threads(previous)
    return output_dir


def assert_matches_one_process(output_dir: Path, one_process: Path) -> None:
    two, one = losses(output_dir), losses(one_process)
    assert [s for s, _, _ in two] == [s for s, _, _ in one]
    assert two[STEPS - 1][2] < two[0][2]
    assert [x for _, _, x in two] == pytest.approx([x for _, _, x in one], rel=1e-5)
    a, b = adapter(output_dir / "adapter"), adapter(one_process / "adapter")
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def assert_lost_steps_repeated(output_dir: Path) -> None:
    crashed = {(s, key): x for s, key, x in losses(output_dir, "crashed_metrics.jsonl")}
    resumed = {(s, key): x for s, key, x in losses(output_dir)}
    lost = [(s, "loss") for s in range(SAVE_EVERY + 1, CRASH_AFTER)]
    assert [resumed[key] for key in lost] == [crashed[key] for key in lost]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_root(tmp_path_factory, "multiprocess")


@pytest.fixture(scope="module")
def one_process(root) -> Path:
    return train_one_process(root)


@pytest.fixture(scope="module")
def runs(root) -> dict[str, Path]:
    runs = {strategy: root / strategy for strategy in ("ddp", "fsdp")}
    crash_then_resume(root, runs)
    return runs


@pytest.fixture(params=["ddp", "fsdp"])
def run(request, runs) -> tuple[str, Path]:
    return request.param, runs[request.param]


def test_a_crash_leaves_the_complete_checkpoints_only(run):
    _, output_dir = run
    assert json.loads((output_dir / "crashed_left.json").read_text()) == [f"step-{SAVE_EVERY:08d}"]


def test_resuming_repeats_the_lost_steps_exactly(run):
    # steps 5 and 6 ran before the crash and again after resuming from step 4: bit for bit the same
    _, output_dir = run
    assert_lost_steps_repeated(output_dir)
    assert [s for s, _, _ in losses(output_dir)] == [*range(1, STEPS + 1), STEPS]  # the log reads as one run


def test_two_processes_match_one_process_with_the_same_global_batch(run, one_process):
    _, output_dir = run
    assert_matches_one_process(output_dir, one_process)


def test_both_processes_end_with_the_adapter_that_was_saved(run):
    _, output_dir = run
    rank0, rank1 = adapter(output_dir / "rank0.safetensors"), adapter(output_dir / "rank1.safetensors")
    assert_same(rank0, rank1)
    assert_same(rank0, adapter(output_dir / "adapter"))
    assert_same(rank0, adapter(output_dir / "checkpoints" / f"step-{STEPS:08d}"))


def test_every_kind_of_adapter_weight_trains(run):
    _, output_dir = run
    middle = adapter(output_dir / "checkpoints" / f"step-{SAVE_EVERY:08d}")
    end = adapter(output_dir / "adapter")
    for prefix in ("modules.", "controller.", "saved.lm_head."):
        names = [k for k in end if k.startswith(prefix)]
        assert names and any(not torch.equal(middle[k], end[k]) for k in names), prefix


def test_fsdp_shards_the_frozen_base_as_well(run):
    strategy, output_dir = run
    for rank in (0, 1):
        record = json.loads((output_dir / f"rank{rank}.json").read_text())
        if strategy == "ddp":
            assert record["held"] == record["numel"] and not record["frozen_sharded"]
        else:  # about half of everything; the controller is whole on each process
            assert record["frozen_sharded"] and record["held"] < 0.6 * record["numel"]
        # accelerate's later calls take their FSDP paths on the CPU too, as on GPUs (its prepare had turned a CPU
        # run back to plain multi-process)
        assert record["accelerate_fsdp2"] == (strategy == "fsdp")
        # a GPU's multi-tensor optimizer step refuses a group that mixes the two (the CPU's does not run)
        assert not record["groups_mix_sharded_and_whole"]


def test_the_saved_adapter_loads_on_one_process(run):
    from transformers import AutoModelForCausalLM

    from bem import BEMModel

    _, output_dir = run
    base = AutoModelForCausalLM.from_pretrained(output_dir / "base_model")
    model = BEMModel.from_pretrained(base, output_dir / "adapter")
    assert_same(model.bem_state_dict(), adapter(output_dir / "adapter"))
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 70, 71, 72, 73, 74]])).logits).all()


def test_checkpoint_layout(run):
    strategy, output_dir = run
    checkpoint = output_dir / "checkpoints" / f"step-{STEPS:08d}"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"rng_rank0.safetensors", "rng_rank1.safetensors", "adapter_model.safetensors"} <= names
    assert not [p for p in (output_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert json.loads((checkpoint / "trainer_state.json").read_text())["distributed"] == strategy
    if strategy == "ddp":
        assert {"optimizer.safetensors", "optimizer.json"} <= names
        return
    # FSDP: each process wrote its own shard of the optimizer state of every sharded weight (all but the
    # controller, which stays whole on each process), and together the shards make the whole
    assert "optimizer.safetensors" not in names
    shards = [load_file(str(checkpoint / f"optimizer_rank{r}.safetensors")) for r in (0, 1)]
    sharded = [json.loads((checkpoint / f"optimizer_rank{r}.json").read_text())["sharded"] for r in (0, 1)]
    assert sharded[0] == sharded[1]
    full = adapter(output_dir / "adapter")
    sharded_numel = sum(t.numel() for k, t in full.items() if not k.startswith("controller."))
    whole_numel = sum(t.numel() for k, t in full.items() if k.startswith("controller."))
    for shard, names in zip(shards, sharded):
        moments = [k for k in shard if k.endswith(".exp_avg")]
        assert 0 < sum(shard[k].numel() for k in moments if k in names) < sharded_numel
        assert sum(shard[k].numel() for k in moments if k not in names) == whole_numel
    assert sum(shard[k].numel() for shard in shards for k in sharded[0] if k.endswith(".exp_avg")) == sharded_numel


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpus_with_nccl(strategy, root, tmp_path):
    """The same run on two GPUs (NCCL): it matches one GPU, both end with the saved adapter, and resuming
    repeats the lost steps (to a tolerance: GPU reductions need not repeat bit for bit)."""
    on_gpu = "training.cpu=false"
    one = tmp_path / "one"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "CRASH_AFTER_STEP": "0", "PYTHONPATH": python_path()}
    single = subprocess.run([sys.executable, str(root / "driver.py"), str(REPO / "configs/tiny.yaml"),
                             *overrides(root / "train.jsonl", one, 1, on_gpu)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-4000:]
    two = tmp_path / "two"
    crash_then_resume(root, {strategy: two}, on_gpu)
    crashed = dict(((s, k), x) for s, k, x in losses(two, "crashed_metrics.jsonl"))
    resumed = dict(((s, k), x) for s, k, x in losses(two))
    lost = [(s, "loss") for s in range(SAVE_EVERY + 1, CRASH_AFTER)]
    assert [resumed[key] for key in lost] == pytest.approx([crashed[key] for key in lost], rel=1e-5)
    assert [x for _, _, x in losses(two)] == pytest.approx([x for _, _, x in losses(one)], rel=1e-4)
    assert_same(adapter(two / "rank0.safetensors"), adapter(two / "rank1.safetensors"))
    assert_same(adapter(two / "rank0.safetensors"), adapter(two / "adapter"))
    a, b = adapter(two / "adapter"), adapter(one / "adapter")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-4)
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["peak_memory_gib_by_rank"] for r in records if "loss" in r]
    assert peaks and all(len(p) == 2 and min(p) > 0 for p in peaks)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_fsdp_tracks_ddp_in_bf16_on_two_gpus(root, tmp_path):
    """The 1B config's precision: a bfloat16 base under bf16 mixed precision, float32 adapter weights. FSDP
    computes with gathered bf16 weights where DDP autocasts, so the two agree to bf16's precision only."""
    bf16 = ("training.cpu=false", "model.dtype=bfloat16", "training.mixed_precision=bf16")
    for strategy, done in side_by_side(root, {s: tmp_path / s for s in ("ddp", "fsdp")}, *bf16).items():
        assert done.returncode == 0, f"{strategy}: {done.stderr[-4000:]}"
    ddp, fsdp = losses(tmp_path / "ddp"), losses(tmp_path / "fsdp")
    assert [key for *key, _ in fsdp] == [key for *key, _ in ddp]
    # each training loss within 2%; the final evaluation, after every step's rounding differences have
    # compounded (learning rate 1e-2), within 5% (it measured 2.5% apart on two H200s)
    for (step, kind, x), (_, _, y) in zip(fsdp, ddp):
        assert x == pytest.approx(y, rel=2e-2 if kind == "loss" else 5e-2), (step, kind)
    saved = adapter(tmp_path / "fsdp" / "adapter")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert_same(adapter(tmp_path / "fsdp" / "rank0.safetensors"), adapter(tmp_path / "fsdp" / "rank1.safetensors"))
