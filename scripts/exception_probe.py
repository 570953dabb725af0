"""Does a C++ exception thrown inside a torch extension reach Python on this machine? Builds a tiny
extension with each linking choice, in a child process each (a crash must not end the probe)."""

import os
import subprocess
import sys
import tempfile
import textwrap

SOURCE = textwrap.dedent("""
    #include <torch/extension.h>
    #include <stdexcept>
    void throw_torch_check() { TORCH_CHECK(false, "torch check reached python"); }
    void throw_std() { throw std::invalid_argument("std exception reached python"); }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
      m.def("throw_torch_check", &throw_torch_check);
      m.def("throw_std", &throw_std);
    }
""")

CHILD = textwrap.dedent("""
    import sys, torch
    from torch.utils.cpp_extension import load_inline
    flags = sys.argv[2:]
    mod = load_inline(name=sys.argv[1], cpp_sources=[open(sys.argv[0] + '.cpp').read()], extra_ldflags=flags,
                      verbose=False)
    for fn in (mod.throw_std, mod.throw_torch_check):
        try:
            fn()
        except Exception as error:
            print(sys.argv[1], 'caught', type(error).__name__, str(error).splitlines()[0])
""")

with tempfile.TemporaryDirectory() as folder:
    script = os.path.join(folder, "child.py")
    open(script, "w").write(CHILD)
    open(script + ".cpp", "w").write(SOURCE)
    for name, flags in (("default_link", []), ("static_runtime", ["-static-libstdc++", "-static-libgcc"])):
        result = subprocess.run([sys.executable, script, name, *flags], capture_output=True, text=True)
        print(f"{name}: exit {result.returncode}")
        print(result.stdout.strip() or result.stderr.strip()[-800:])
for command in ("g++ --version", "/opt/gcc/bin/g++ --version", "which g++ c++", "ls /usr/bin/g++*"):
    print("$", command, "\n", subprocess.run(command, shell=True, capture_output=True, text=True).stdout[:300])
import torch  # noqa: E402

print([line.split()[-1] for line in open("/proc/self/maps") if "libstdc++" in line or "libgcc_s" in line][:4])
