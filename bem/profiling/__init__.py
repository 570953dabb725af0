"""BEM's overhead profiler: base vs BEM vs PEFT LoRA on one model, and the kernel micro-benchmark.

    python profile.py --config configs/profile_tiny.yaml      # or: bem profile ...
    python profile.py --sweep                                 # every shape family, one after another

`run_profile(config)` returns the report dict (schema in docs/profiling.md, checked by
`validate_report`): every overhead with its interval and every gated setting judged pass, fail or
undecided. The command line lives in `bem.profiling.cli`, the sweep in `bem.profiling.sweep`.
"""

from .config import ProfileConfig, ProfileConfigError, load_profile_config
from .runner import run_profile
from .schema import validate_report, validate_sweep_summary

__all__ = ["ProfileConfig", "ProfileConfigError", "load_profile_config", "run_profile", "validate_report",
           "validate_sweep_summary"]
