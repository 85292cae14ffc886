"""The C++ compiler AOTInductor builds graphs with, chosen so the graph runs in this process.

A compiled graph instantiates libstdc++ templates (std::regex, in AOTInductor's device-string
parser) from its compiler's headers and resolves the rest against whatever libstdc++ the loading
process already holds. When the two come from different GCC releases the graph can crash on load:
on the lent H200 image `$CXX` is /opt/gcc/bin/g++ while the Python process runs the system
libstdc++ (GCC 13), and every graph built with `$CXX` segfaulted inside std::regex's compiler
(benchmarks/AOTI_LOAD_NOTES.md). So trtbuild picks the first compiler whose own libstdc++ *is* the
one mapped into this process; if none is, it links the graph with a private static libstdc++
(`g++-static.sh`), which needs no match. The choice is part of the engine's toolchain, so the key.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The name must contain "g++": Inductor decides from the path whether the compiler is GCC.
STATIC_WRAPPER = Path(__file__).with_name("g++-static.sh")


@dataclass(frozen=True)
class Compiler:
    path: str  # what Inductor runs (the static wrapper when static is True)
    version: str  # "gcc 13.3.0": goes into the key
    libstdcxx: str | None  # the compiler's own libstdc++.so.6, resolved
    static: bool  # the graph carries its own libstdc++ (no compiler matched this process)

    def describe(self) -> str:
        return f"{self.version}{' (static libstdc++)' if self.static else ''}"


def loaded_libstdcxx() -> str | None:
    """The libstdc++ this process has mapped (after importing torch), resolved; None if none is."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libstdc++.so" in line}
    except OSError:
        return None
    return os.path.realpath(sorted(paths)[0]) if paths else None


def _ask(cxx: str, *args: str) -> str | None:
    try:
        out = subprocess.run([cxx, *args], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip() or None


def _describe(cxx: str) -> tuple[str, str | None] | None:
    banner = _ask(cxx, "--version")
    if banner is None:
        return None
    family = "clang" if "clang" in banner.splitlines()[0].lower() else "gcc"
    lib = _ask(cxx, "-print-file-name=libstdc++.so.6")
    lib = os.path.realpath(lib) if lib and os.path.isabs(lib) and os.path.exists(lib) else None
    return f"{family} {_ask(cxx, '-dumpfullversion') or _ask(cxx, '-dumpversion') or '?'}", lib


def candidates() -> list[str]:
    """$CXX first (what Inductor would use), then the usual names on PATH and the system compiler."""
    seen: list[str] = []
    for name in (os.environ.get("CXX"), "g++", "c++", "/usr/bin/g++", "clang++"):
        path = shutil.which(name) if name else None
        if path and os.path.realpath(path) not in {os.path.realpath(p) for p in seen}:
            seen.append(path)
    return seen


@functools.cache
def choose() -> Compiler:
    """`TRTBUILD_CXX=/path/to/g++` pins the compiler; `TRTBUILD_CXX=static` forces the static link."""
    import torch  # noqa: F401  - its libstdc++ must be mapped before we look

    loaded, pinned = loaded_libstdcxx(), os.environ.get("TRTBUILD_CXX", "")
    names = [pinned] if pinned and pinned != "static" else candidates()
    described = [(path, d) for path in names if (d := _describe(path)) is not None]
    if not described:
        return Compiler(path=os.environ.get("CXX", "g++"), version="unknown", libstdcxx=None, static=False)
    for path, (version, lib) in described:
        if pinned != "static" and (loaded is None or lib == loaded or pinned):
            return Compiler(path=path, version=version, libstdcxx=lib, static=False)
    path, (version, lib) = described[0]
    os.environ.setdefault("TRTBUILD_REAL_CXX", path)
    return Compiler(path=str(STATIC_WRAPPER), version=version, libstdcxx=lib, static=True)
