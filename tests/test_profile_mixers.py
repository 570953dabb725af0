"""The profile's mixer settings: prefill and decoding again with BEM plus each listed mixer, never gated."""

from __future__ import annotations

import json

import pytest

from bem.profiling.cli import main
from bem.profiling.config import ProfileConfigError, profile_config_from_dict
from bem.profiling.schema import validate_report
from test_profile_cli import _small_profile


def test_mixer_settings_are_measured_and_left_ungated(tmp_path):
    path = _small_profile(tmp_path, mixers=["hyena", "mlstm"], train={"enabled": False},
                          bem={"rank": 4, "alpha": 8.0, "mixer_dim": 16, "mixer_heads": 2, "mixer_max_length": 64})
    code = main(["--config", str(path), "--quiet"])
    report = json.loads((tmp_path / "tiny.json").read_text())
    assert validate_report(report) == []
    rows = {s["name"]: s for s in report["settings"]}
    for kind in ("hyena", "mlstm"):
        for name in ("prefill b1 s16", "decode b1"):
            row = rows[f"{name} [+{kind}]"]
            assert not row["gated"] and row["verdict"] == "ungated" and row["bem"] > 0 and row["base"] > 0
    assert rows["prefill b1 s16"]["gated"]  # BEM's own rows stay gated
    assert code in (0, 3)  # the tiny CPU model's gate at 1000%: passed, or undecided by noise


def test_an_unknown_mixer_kind_is_refused():
    with pytest.raises(ProfileConfigError, match=r"mixers\[\] must be one of hyena, mlstm; got 'hyenna'"):
        profile_config_from_dict({"mixers": ["hyenna"]})
