"""`model.quantization` in `bem train`'s and `profile.py`'s YAML: checked like every other key (errors name the
field), and a QLoRA-style `bem train` run on a 4-bit base end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from bem.profiling.cli import main as profile_main
from bem.quantization import bitsandbytes_config, check_quantization
from bem.training import ConfigError, load_train_config
from bem.training.cli import train_main

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"

BAD = [
    ({"bits": 3}, "model.quantization.bits: must be 4 or 8, got 3"),
    ({"bits": True}, "model.quantization.bits: must be 4 or 8, got True"),
    ({}, "model.quantization.bits: must be 4 or 8, got None"),
    ({"bits": 4, "quant_type": "int4"}, "model.quantization.quant_type: must be 'nf4' or 'fp4', got 'int4'"),
    ({"bits": 4, "compute_dtype": "fp16"}, "model.quantization.compute_dtype: must be one of float32, float16, "
                                           "bfloat16, got 'fp16'"),
    ({"bits": 4, "double_quant": "yes"}, "model.quantization.double_quant: must be true or false, got 'yes'"),
    ({"bits": 4, "quant_storage": "int8"}, "model.quantization.quant_storage: must be one of uint8, float32, "
                                           "float16, bfloat16, got 'int8'"),
    ({"bits": 8, "quant_type": "nf4"}, "model.quantization.quant_type: applies to 4-bit bases only (bits is 8)"),
    ({"bits": 8, "quant_storage": "bfloat16"}, "model.quantization.quant_storage: applies to 4-bit bases only"),
    ({"bits": 4, "blocksize": 64}, "model.quantization.blocksize: unknown key; the keys are bits, quant_type"),
    ("nf4", "model.quantization: must be a mapping"),
]


@pytest.mark.parametrize("values, message", BAD)
def test_a_bad_quantization_section_names_its_field(values, message):
    with pytest.raises(ValueError) as caught:
        check_quantization(values)
    assert message in str(caught.value)


def test_defaults_and_the_bitsandbytes_config_they_make():
    assert check_quantization(None) is None
    four = check_quantization({"bits": 4})
    assert four == {"bits": 4, "quant_type": "nf4", "compute_dtype": "bfloat16", "double_quant": False,
                    "quant_storage": "uint8"}
    assert check_quantization({"bits": 8}) == {"bits": 8}
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    config = bitsandbytes_config(check_quantization({"bits": 4, "quant_type": "fp4", "compute_dtype": "float16",
                                                     "double_quant": True, "quant_storage": "bfloat16"}))
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "fp4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == torch.float16 and config.bnb_4bit_quant_storage == torch.bfloat16
    assert bitsandbytes_config(four).bnb_4bit_quant_storage == torch.uint8
    assert bitsandbytes_config({"bits": 8}).load_in_8bit


def write_train_config(tmp_path: Path, quantization, **training) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["data"]["train"] = str(REPO / "data/tiny/train.jsonl")
    raw["data"]["eval"] = str(REPO / "data/tiny/eval.jsonl")
    raw["training"].update(output_dir=str(tmp_path / "run"), **training)
    raw["model"]["quantization"] = quantization
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_train_config_refuses_a_bad_section_before_loading_anything(tmp_path, capsys):
    path = write_train_config(tmp_path, {"bits": 4, "quant_type": "int4"})
    with pytest.raises(ConfigError, match="model.quantization.quant_type"):
        load_train_config(path)
    assert train_main([str(path)]) == 2
    assert "model.quantization.quant_type" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_profile_config_refuses_a_bad_section(tmp_path, capsys):
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump({"model": {"quantization": {"bits": 2}}}))
    assert profile_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.quantization.bits: must be 4 or 8, got 2" in err and "Traceback" not in err


def test_a_qlora_style_run_trains_on_a_4_bit_base(tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    path = write_train_config(tmp_path, {"bits": 4, "quant_type": "nf4", "compute_dtype": "float32"},
                              max_steps=16, warmup_steps=0, batch_size=8, log_every=4, eval_every=0, save_every=16)
    assert train_main([str(path), "logging.console=false"]) == 0
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["quantization"]["bits"] == 4
    # the fresh base is kept in full precision, so the adapter loads onto it quantized anew
    assert (run / "base_model" / "config.json").is_file()
    assert "quantization_config" not in json.loads((run / "base_model" / "config.json").read_text())


def test_the_4_bit_profile_config_loads_with_its_quantization():
    from bem.profiling.config import load_profile_config

    config = load_profile_config(REPO / "configs" / "profile_qwen2_0.5b_nf4.yaml")
    assert config.model.quantization == {"bits": 4, "quant_type": "nf4", "compute_dtype": "bfloat16",
                                         "double_quant": False, "quant_storage": "uint8"}
    hf = config.model.config
    assert (hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]) == (896, 4864, 24)


def test_the_8b_4_bit_profile_config_is_the_8b_config_on_a_4_bit_base():
    from bem.profiling.config import load_profile_config

    quantized = load_profile_config(REPO / "configs" / "profile_llama3_8b_nf4.yaml")
    plain = load_profile_config(REPO / "configs" / "profile_llama3_8b.yaml")
    assert quantized.model.quantization == {"bits": 4, "quant_type": "nf4", "compute_dtype": "bfloat16",
                                            "double_quant": True, "quant_storage": "uint8"}
    assert quantized.model.config == plain.model.config and quantized.train == plain.train
    assert quantized.bem_config() == plain.bem_config()
