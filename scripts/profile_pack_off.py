"""`profile.py` with BEM's adapter pack off: generate's compiled decoding step then reads each wrapped layer's V
and U as inputs of their own, as before the pack. The baseline for measuring what the pack saves:

    python scripts/profile_pack_off.py --sweep ...   (the arguments of profile.py)
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from bem.model import BEMModel

BEMModel._adapter_pack = lambda self: None  # type: ignore[method-assign]
profile = Path(__file__).resolve().parent.parent / "profile.py"
sys.argv[0] = str(profile)
runpy.run_path(str(profile), run_name="__main__")
