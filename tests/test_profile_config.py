"""Profile configs and arguments: what is accepted, and the exit-2 messages for what is not."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bem.profiling.cli import main
from bem.profiling.config import ProfileConfig, ProfileConfigError, load_profile_config

REPO = Path(__file__).resolve().parents[1]


def test_profile_tiny_yaml_is_the_default():
    assert load_profile_config(REPO / "configs" / "profile_tiny.yaml") == ProfileConfig()


def test_llama_1b_config_matches_the_llama_3_2_1b_shapes():
    config = load_profile_config(REPO / "configs" / "profile_llama_1b.yaml")
    hf = config.model.config
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"]) == (2048, 16, 8192)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"]) == (32, 8)
    assert config.model.dtype == "bfloat16" and config.device == "cuda"
    bem = config.bem_config()
    assert bem.rank == 8 and bem.attach_mlp and bem.attach_attention and bem.attach_qkv
    assert [4, 1024] in config.prefill.shapes and {1, 16} <= set(config.decode.batch_sizes)
    assert config.max_overhead == 0.15


def test_gpt2_config_has_gpt2_small_shapes_and_loads():
    config = load_profile_config(REPO / "configs" / "profile_gpt2.yaml")
    hf = config.model.config
    assert hf["model_type"] == "gpt2" and (hf["n_embd"], hf["n_layer"], hf["n_head"], hf["n_inner"]) == (768, 12, 12, 3072)
    assert config.model.dtype == "bfloat16" and config.device == "cuda"
    bem = config.bem_config()
    assert bem.rank == 8 and bem.attach_mlp and bem.attach_attention and bem.attach_qkv
    assert all(batch * length <= 8192 and length <= hf["n_positions"] for batch, length in config.prefill.shapes)
    assert config.decode.prompt_length + config.decode.new_tokens <= hf["n_positions"]
    assert config.train.sequence_length <= hf["n_positions"]


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("data, expected", [
    ({"prefil": {"shapes": [[1, 8]]}}, "unknown key 'prefil' (did you mean 'prefill'?)"),
    ({"decode": {"batch_size": [1]}}, "unknown key 'decode.batch_size' (did you mean 'decode.batch_sizes'"),
    ({"decode": {"new_tokens": 1}}, "decode.new_tokens must be an integer >= 2"),
    ({"prefill": {"shapes": [[1]]}}, "prefill.shapes rows must be lists of 2 positive integers"),
    ({"device": "gpu"}, "device must be one of auto, cpu, cuda"),
    ({"model": {"dtype": "bf16"}}, "model.dtype must be one of"),
    ({"bem": {"rank": 0}}, "bem: rank must be a positive integer"),
    ({"bem": {"ranks": 8}}, "unknown BEM config field 'ranks' (did you mean 'rank'?)"),
    ({"gate": ["prefil"]}, "gate[] must be one of prefill, decode, decode_compiled, train; got 'prefil' (did you mean 'prefill'?)"),
    ({"max_overhead": -0.1}, "max_overhead must be in"),
    ({"timing": 3}, "timing must be a mapping"),
    ({"timing": {"repeats": 5}}, "unknown key 'timing.repeats' (did you mean 'timing."),
    ({"timing": {"min_repeats": 8, "max_repeats": 6}}, "timing.max_repeats must be >= timing.min_repeats (8)"),
    ({"timing": {"min_repeats": 3, "max_repeats": 4}}, "timing.max_repeats must be at least 5 for a 90% interval"),
    ({"timing": {"confidence": 0.95, "min_repeats": 5, "max_repeats": 5}}, "at least 6 for a 95% interval"),
    ({"timing": {"confidence": 1.0}}, "timing.confidence must be in [0.5, 0.999]"),
    ({"timing": {"target_spread": -0.01}}, "timing.target_spread must be in"),
    ({"model": {"config": {"vocab_size": 8}}}, "model.config must be a mapping with a model_type"),
])
def test_bad_configs_exit_2_with_a_clear_message(tmp_path, capsys, data, expected):
    assert main(["--config", str(_write(tmp_path, data))]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err


def test_missing_config_file_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["--config", str(missing)]) == 2
    assert f"config file not found: {missing}" in capsys.readouterr().err


def test_invalid_yaml_exits_2(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("prefill: [unclosed\n")
    assert main(["--config", str(path)]) == 2
    assert "is not valid YAML" in capsys.readouterr().err


def test_missing_model_directory_exits_2(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "no_model"), "--output-dir", str(tmp_path)]) == 2
    assert "model.path is not a directory" in capsys.readouterr().err


def test_unknown_model_type_exits_2(tmp_path, capsys):
    path = _write(tmp_path, {"model": {"config": {"model_type": "lama"}}})
    assert main(["--config", str(path)]) == 2
    assert "model.config is not a valid 'lama' config" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--max-overhead", "abc"], "expected a number such as 0.15"),
    (["--max-overhead", "-1"], "must be a finite number >= 0"),
    (["--repeats", "0"], "expected a positive integer"),
    (["--repeats", "3"], "timing.max_repeats must be at least 5 for a 90% interval"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_exit_2(capsys, argv, expected):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "bem profile" in err


def test_from_report_rejects_a_file_that_is_not_a_report(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text('{"kind": "something else"}')
    assert main(["--from-report", str(path)]) == 2
    assert "does not match the report schema" in capsys.readouterr().err
    assert main(["--from-report", str(tmp_path / "absent.json")]) == 2
    assert "report not found" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--max-overhead" in capsys.readouterr().out


def test_programmatic_config_errors_name_the_field():
    with pytest.raises(ProfileConfigError, match="timing.min_repeats"):
        ProfileConfig(timing=type(ProfileConfig().timing)(min_repeats=0))
