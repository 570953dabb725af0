"""`python profile.py [options]`: BEM's overhead profiler, the same as `bem profile [options]`.

Imported as a module (the repository root on sys.path makes this file shadow the standard library's
`profile`, which `cProfile` imports), it stands in for that standard module instead.
"""

import sys

if __name__ == "__main__":
    from bem.profiling.cli import main

    sys.exit(main(sys.argv[1:]))
else:
    import importlib.util
    import sysconfig
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location(__name__, Path(sysconfig.get_paths()["stdlib"]) / "profile.py")
    _stdlib = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_stdlib)
    globals().update({k: v for k, v in vars(_stdlib).items() if not k.startswith("__")})
    __all__ = _stdlib.__all__
