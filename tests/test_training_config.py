"""Training config errors: each names the key (or path), exits 2 on stderr, and nothing is loaded or trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bem.training import ConfigError, load_train_config
from bem.training.cli import train_main

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"


def write_config(tmp_path: Path, mutate=None) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["data"]["train"] = str(REPO / "data/tiny/train.jsonl")
    raw["data"]["eval"] = str(REPO / "data/tiny/eval.jsonl")
    raw["training"]["output_dir"] = str(tmp_path / "run")
    if mutate is not None:
        mutate(raw)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail loudly if anything tries to build a model."""
    import bem.training.model_factory as factory

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded although the config is invalid")

    monkeypatch.setattr(factory, "build_base_model", refuse)
    monkeypatch.setattr(factory, "load_tokenizer", refuse)


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = train_main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_tiny_config_is_valid():
    config = load_train_config(TINY)
    assert config.model.architecture == "llama"
    assert config.bem.rank == 16
    assert config.training.max_steps == 200


def mutate_typo(raw):
    raw["training"]["learning_rate"] = 1e-3


def mutate_bem_typo(raw):
    raw["bem"]["rnak"] = 4


def mutate_type(raw):
    raw["training"]["batch_size"] = "eight"


def mutate_missing_file(raw):
    raw["data"]["train"] = "/nonexistent/train.jsonl"


def mutate_section(raw):
    raw["trainig"] = raw.pop("training")


def mutate_bem_value(raw):
    raw["bem"]["dropout"] = 1.5


def mutate_strategy(raw):
    raw["training"]["distributed"] = "zero3"


def mutate_strategy_key(raw):
    raw["training"]["strategy"] = "fsdp"


@pytest.mark.parametrize("mutate, expected", [
    (mutate_typo, ["training.learning_rate", "unknown key", "did you mean 'lr'"]),
    (mutate_bem_typo, ["bem.rnak", "did you mean 'rank'"]),
    (mutate_type, ["training.batch_size", "expected an integer", "'eight'"]),
    (mutate_missing_file, ["data.train", "/nonexistent/train.jsonl"]),
    (mutate_section, ["trainig", "did you mean 'training'"]),
    (mutate_bem_value, ["bem.dropout", "1.5"]),
    (mutate_strategy, ["training.distributed", "'ddp', 'fsdp'", "'zero3'"]),
    (mutate_strategy_key, ["training.strategy", "did you mean 'distributed'"]),
])
def test_config_errors_exit_2_before_any_model(tmp_path, capsys, no_model_loading, mutate, expected):
    code, out, err = run_cli([write_config(tmp_path, mutate)], capsys)
    assert code == 2
    assert out == ""
    for fragment in expected:
        assert fragment in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, expected", [
    ("training.lr", "section.key=value"),
    ("training.lr=abc", "training.lr: expected a number"),
    ("training.lrr=3e-4", "did you mean 'lr'"),
    ("trainng.lr=3e-4", "did you mean 'training'"),
    ("training.lr.x=1", "takes a value, not sub-keys"),
    ("model.config_overrides.hidden_sise=64", "has no attribute 'hidden_sise'"),
])
def test_bad_overrides_exit_2(tmp_path, capsys, no_model_loading, override, expected):
    code, _, err = run_cli([write_config(tmp_path), override], capsys)
    assert code == 2
    assert expected in err


def test_distributed_defaults_to_ddp_and_takes_fsdp(tmp_path):
    assert load_train_config(write_config(tmp_path)).training.distributed == "ddp"
    assert load_train_config(write_config(tmp_path), ["training.distributed=fsdp"]).training.distributed == "fsdp"


def test_overrides_apply_and_parse_yaml_values(tmp_path):
    config = load_train_config(write_config(tmp_path), ["training.lr=3e-4", "bem.rank=4", "data.packing=true",
                                                        "model.config_overrides.num_hidden_layers=1"])
    assert config.training.lr == pytest.approx(3e-4)
    assert config.bem.rank == 4
    assert config.data.packing is True
    assert config.model.config_overrides == {"num_hidden_layers": 1}


def test_missing_config_file_and_usage_errors(tmp_path, capsys):
    code, _, err = run_cli([tmp_path / "absent.yaml"], capsys)
    assert code == 2 and "config file not found" in err
    code, _, err = run_cli([], capsys)
    assert code == 2 and "usage: bem train" in err
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0 and "KEY=VALUE" in out


def test_existing_checkpoints_need_resume(tmp_path, capsys, no_model_loading):
    path = write_config(tmp_path)
    step_dir = tmp_path / "run" / "checkpoints" / "step-00000010"
    step_dir.mkdir(parents=True)
    (step_dir / "trainer_state.json").write_text("{}")
    code, _, err = run_cli([path], capsys)
    assert code == 2 and "training.resume=latest" in err
    code, _, err = run_cli([path, f"training.resume={tmp_path / 'nowhere'}"], capsys)
    assert code == 2 and "training.resume" in err and "nowhere" in err


def test_tensorboard_and_datasets_are_optional_with_clear_errors(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ConfigError, match="logging.tensorboard.*pip install tensorboard"):
            load_train_config(write_config(tmp_path), ["logging.tensorboard=true"])
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(ConfigError, match="data.train.*datasets package is not installed"):
            load_train_config(write_config(tmp_path), [f"data.train={tmp_path}"])


def test_print_config_shows_defaults(tmp_path, capsys):
    code, out, _ = run_cli([write_config(tmp_path), "--print-config", "training.seed=7"], capsys)
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["training"]["seed"] == 7
    assert printed["training"]["gradient_accumulation_steps"] == 1  # a default, filled in
    assert printed["bem"]["chunk_size"] == 16


def test_fsdp_names_the_torch_it_needs(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")
    with pytest.raises(ConfigError, match=r"training.distributed: fsdp needs torch >= 2.7.*2.6.0"):
        load_train_config(write_config(tmp_path), ["training.distributed=fsdp"])
    load_train_config(write_config(tmp_path), ["training.distributed=ddp"])
