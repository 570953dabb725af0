"""BEM's overhead profiler: base vs BEM vs PEFT LoRA on one model, and the kernel micro-benchmark.

    python profile.py --config configs/profile_tiny.yaml      # or: bem profile ...

`run_profile(config)` returns the report dict (schema in docs/profiling.md, checked by
`validate_report`); the command line lives in `bem.profiling.cli`.
"""

from .config import ProfileConfig, ProfileConfigError, load_profile_config
from .runner import run_profile
from .schema import validate_report

__all__ = ["ProfileConfig", "ProfileConfigError", "load_profile_config", "run_profile", "validate_report"]
