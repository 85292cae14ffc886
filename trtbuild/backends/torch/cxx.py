"""The C++ side of compiled graphs: which compiler builds them, and one libstdc++ for the process.

A compiled AOTInductor graph instantiates libstdc++ templates inline (std::regex, in AOTInductor's
device-string parser) and binds the rest -- std::locale's facet ids among them -- to the first
definition the dynamic linker finds: the process's global scope first, then the graph's own
dependencies. Python loads extension modules, and the libstdc++ they need, privately (RTLD_LOCAL), so
libstdc++ is usually not in the global scope at all. On the lent H200 image every graph then crashed
on load: the locale was built by one copy of those symbols and queried with another's ids, so
use_facet returned the wrong facet and a virtual call landed in codecvt<char16_t>::do_unshift
(seen in two builds; docs/aoti_load.md). Which other copy the graph bound
to was not established: no library in the global scope exported them (checked there), so it came
from the graph's own dependencies. The same engines ran with the system libstdc++ first in the
global scope -- by LD_PRELOAD, and then by `make_global`, with no workaround (8B recipe, H200).

So trtbuild makes the libstdc++ the process already runs global when it is imported and again
before it loads any graph, and `check_symbols` refuses, with the remedy, a process where another
library would still serve those symbols first.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trtbuild.errors import TrtbuildError

# std::ctype<char>::id, std::__cxx11::collate<char>::id, std::locale::classic(): what std::regex
# reaches through the locale. A definition outside libstdc++ is the crash above.
_PROBE_SYMBOLS = ("_ZNSt5ctypeIcE2idE", "_ZNSt7__cxx117collateIcE2idE", "_ZNSt6locale7classicEv")


def make_global() -> None:
    """Put libstdc++ in the global scope (dlopen RTLD_GLOBAL): the copy already mapped if there is
    one (dlopen of a loaded library only promotes it), else the one the loader finds."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(loaded_libstdcxx() or "libstdc++.so.6", mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError:  # no libstdc++ here: nothing to keep consistent
        pass


def loaded_libstdcxx() -> str | None:
    """The libstdc++ this process has mapped, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    except OSError:
        return None
    return paths[0] if paths else None


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
    """Before loading a compiled graph: libstdc++ global, and serving its own locale symbols; else
    refuse, with the remedy, rather than let the graph crash the process."""
    make_global()
    shadows = shadowing_libraries()
    if shadows:
        libs = ", ".join(sorted(set(shadows.values())))
        raise TrtbuildError(
            f"{graph}: this process resolves libstdc++'s locale symbols from {libs}, not libstdc++; the "
            "compiled graph would crash on load (docs/aoti_load.md)",
            hint="import trtbuild before torch, or start the process with "
                 "LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)")


@dataclass(frozen=True)
class Compiler:
    path: str
    version: str  # "gcc 13.3.0": part of the engine's toolchain, so of its key


@functools.cache
def compiler() -> Compiler:
    """The compiler graphs are built with: Inductor's own default ($CXX, else g++; clang++ on macOS),
    which the build then pins in Inductor's config. Asking Inductor itself would import it: a second
    on every start-up, for a name."""
    path = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    try:
        banner = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        full = subprocess.run([path, "-dumpfullversion"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return Compiler(path=path, version="unknown")
    family = "clang" if "clang" in (banner.splitlines() or [""])[0].lower() else "gcc"
    return Compiler(path=path, version=f"{family} {full.strip() or '?'}")


@contextlib.contextmanager
def overlapped_objects() -> Iterator[None]:
    """While a graph compiles: its C++ wrapper's object file is compiled beside its kernels' instead of before.

    AOTInductor compiles a program as two objects, the wrapper and the kernels, one after the other, then links
    them. For a CPU program both are real work (tiny-llama on 2 cores: wrapper 4.0 s, kernels 1.1 s), so the
    wrapper's compiler runs in a thread of its own while the kernels' runs, and the link waits for it. A
    failure of the wrapper's compile is raised at the link, unchanged. Its seconds are not among Inductor's
    `compile_file` timers (the compile phase's wall time has them)."""
    from torch._inductor import cpp_builder

    original = cpp_builder.CppBuilder.build
    pending: list[tuple[threading.Thread, list[BaseException]]] = []

    def wait() -> None:
        while pending:
            thread, errors = pending.pop(0)
            thread.join()
            if errors:
                raise errors[0]

    def build(builder: Any) -> None:
        if builder._compile_only and not builder._use_relative_path and builder._name.endswith(".wrapper"):
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    tmp = os.path.join(builder._output_dir, f"{builder._name}_overlapped")
                    os.makedirs(tmp, exist_ok=True)
                    cpp_builder._run_compile_cmd(builder.get_command_line(), cwd=tmp)
                    os.rmdir(tmp)
                except BaseException as e:  # raised where the link waits for it
                    errors.append(e)

            thread = threading.Thread(target=run, name="trtbuild-wrapper-cxx", daemon=True)
            thread.start()
            pending.append((thread, errors))
            return
        if not builder._compile_only:  # a link (or a header) needs every object before it
            wait()
        original(builder)

    cpp_builder.CppBuilder.build = build  # type: ignore[method-assign]
    try:
        yield
        wait()
    finally:
        cpp_builder.CppBuilder.build = original  # type: ignore[method-assign]
        for thread, _ in pending:
            thread.join()
