"""HierarchicalBEMConfig: round trips, and errors that name the bad field."""

from __future__ import annotations

import pytest

from bem import HierarchicalBEMConfig


def test_defaults_match_the_design():
    config = HierarchicalBEMConfig()
    assert (config.rank, config.alpha, config.chunk_size, config.max_prefix_tokens) == (8, 16.0, 32, 128)
    assert config.scaling == 2.0 and config.enable_routing and config.use_fused_kernels


def test_yaml_and_dict_round_trip(tmp_path):
    config = HierarchicalBEMConfig(rank=16, alpha=32.0, chunk_size=64, target_modules=["q_proj", "v_proj"],
                                   side_signal_dim=4, enable_uncertainty=False)
    assert HierarchicalBEMConfig.from_dict(config.to_dict()) == config
    assert HierarchicalBEMConfig.from_yaml(config.to_yaml()) == config
    path = tmp_path / "bem.yaml"
    config.to_yaml(path)
    assert HierarchicalBEMConfig.from_yaml(path) == config
    assert HierarchicalBEMConfig.from_yaml(str(path)) == config
    (tmp_path / "nested.yaml").write_text("bem:\n  rank: 4\n  target_modules: '.*proj'\n")
    assert HierarchicalBEMConfig.from_yaml(tmp_path / "nested.yaml").target_modules == ".*proj"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rank", 0, "rank must be a positive integer"),
        ("rank", 2.5, "rank must be a positive integer"),
        ("rank", True, "rank must be a positive integer"),
        ("alpha", -1.0, "alpha must be > 0"),
        ("alpha", float("nan"), "alpha must be a finite number"),
        ("dropout", 1.0, r"dropout must be in \[0, 1\)"),
        ("chunk_size", 0, "chunk_size must be a positive integer"),
        ("max_prefix_tokens", -3, "max_prefix_tokens must be a positive integer"),
        ("ema_decay", 1.0, r"ema_decay must be in \[0, 1\)"),
        ("code_clamp_value", 0.0, "code_clamp_value must be > 0"),
        ("side_signal_dim", 0, "side_signal_dim must be a positive integer or null"),
        ("enable_uncertainty", "yes", "enable_uncertainty must be true or false"),
        ("use_fused_kernels", 1, "use_fused_kernels must be true or false"),
        ("target_modules", [], "target_modules must be a regex string or a non-empty list"),
        ("target_modules", "(unclosed", "target_modules is not a valid regular expression"),
        ("controller_dim", 0, "controller_dim must be a positive integer"),
    ],
)
def test_invalid_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        HierarchicalBEMConfig(**{field: value})


def test_nothing_to_attach_is_rejected():
    with pytest.raises(ValueError, match="nothing would be wrapped"):
        HierarchicalBEMConfig(attach_mlp=False, attach_attention=False, attach_qkv=False)


def test_unknown_keys_are_rejected_with_a_suggestion(tmp_path):
    with pytest.raises(ValueError, match=r"unknown BEM config field 'chunk_sise' \(did you mean 'chunk_size'\?\)"):
        HierarchicalBEMConfig.from_dict({"chunk_sise": 16})
    (tmp_path / "bad.yaml").write_text("rank: 8\nalpah: 3\n")
    with pytest.raises(ValueError, match="did you mean 'alpha'"):
        HierarchicalBEMConfig.from_yaml(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="unknown BEM config field 'zzz'$"):
        HierarchicalBEMConfig.from_dict({"zzz": 1})
