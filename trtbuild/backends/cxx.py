"""The C++ side of compiled graphs: which compiler builds them, and one libstdc++ for the process.

A compiled AOTInductor graph instantiates libstdc++ templates inline (std::regex, in AOTInductor's
device-string parser) and binds the rest -- the facet ids of std::locale among them -- to whatever
definition the dynamic linker finds first, searching the process's global scope before the
graph's own dependencies. On the lent H200 image a library that torch loads into the global scope
brings its own copy of those symbols; the graph then asks the system libstdc++'s locale for a facet
by the other copy's id, gets the wrong facet, and segfaults in a virtual call (seen: regex_traits::
transform_primary landing in codecvt<char16_t>::do_unshift; benchmarks/AOTI_LOAD_NOTES.md). The
same engine runs once the system libstdc++ is first in the global scope (LD_PRELOAD did it there).

So importing trtbuild puts libstdc++ into the global scope, which is first only if torch is not
imported yet; before any graph is loaded `check_symbols` looks where those symbols resolve and, if
another library would serve them, raises an error that says what to do instead of crashing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
from dataclasses import dataclass

from trtbuild.errors import TrtbuildError

# std::ctype<char>::id, std::__cxx11::collate<char>::id, std::locale::classic(): what std::regex
# reaches through the locale. A definition outside libstdc++ is the crash above.
_PROBE_SYMBOLS = ("_ZNSt5ctypeIcE2idE", "_ZNSt7__cxx117collateIcE2idE", "_ZNSt6locale7classicEv")


def make_global() -> None:
    """dlopen libstdc++ with RTLD_GLOBAL: first in the global scope when nothing else is there yet."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError:  # no libstdc++ here: nothing can shadow it either
        pass


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def shadowing_libraries() -> dict[str, str]:
    """Symbol -> library, for each probe symbol the global scope resolves outside libstdc++."""
    if sys.platform != "linux":
        return {}
    libc = ctypes.CDLL(None)
    libc.dlsym.restype, libc.dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    libc.dladdr.restype, libc.dladdr.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    found: dict[str, str] = {}
    for name in _PROBE_SYMBOLS:
        addr = libc.dlsym(None, name.encode())  # NULL handle = RTLD_DEFAULT: the global scope, in order
        info = _DlInfo()
        if addr and libc.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            lib = info.dli_fname.decode(errors="replace")
            if not os.path.basename(lib).startswith("libstdc++"):
                found[name] = lib
    return found


def check_symbols(graph: str) -> None:
    """Refuse, with the remedy, to load a compiled graph that would bind libstdc++ symbols elsewhere."""
    shadows = shadowing_libraries()
    if shadows:
        libs = ", ".join(sorted(set(shadows.values())))
        raise TrtbuildError(
            f"{graph}: this process resolves libstdc++'s locale symbols from {libs}, not libstdc++; the "
            "compiled graph would crash on load (benchmarks/AOTI_LOAD_NOTES.md)",
            hint="import trtbuild before torch, or start the process with "
                 "LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)")


@dataclass(frozen=True)
class Compiler:
    path: str
    version: str  # "gcc 13.3.0": part of the engine's toolchain, so of its key


@functools.cache
def compiler() -> Compiler:
    """The compiler Inductor will run ($CXX, else g++), as Inductor itself finds it."""
    path = os.environ.get("CXX") or "g++"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        path = get_cpp_compiler()
    except Exception:  # an Inductor without this helper: fall back to its documented default
        pass
    try:
        banner = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        full = subprocess.run([path, "-dumpfullversion"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return Compiler(path=path, version="unknown")
    family = "clang" if "clang" in (banner.splitlines() or [""])[0].lower() else "gcc"
    return Compiler(path=path, version=f"{family} {full.strip() or '?'}")
