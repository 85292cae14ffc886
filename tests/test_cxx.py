"""One libstdc++ for compiled graphs: the condition that crashed every graph on the H200 image, made
here with a tiny library that exports two of libstdc++'s locale facet ids (trtbuild/backends/torch/cxx.py); and
a graph's wrapper object compiled beside its kernels'."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO

pytestmark = pytest.mark.skipif(sys.platform != "linux" or shutil.which("gcc") is None,
                                reason="needs Linux and gcc to make the shadowing library")


@pytest.fixture(scope="session")
def shadow_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("shadow")
    (folder / "shadow.c").write_text("int _ZNSt5ctypeIcE2idE = 0;\nint _ZNSt7__cxx117collateIcE2idE = 0;\n")
    lib = folder / "libshadow.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(folder / "shadow.c")], check=True)
    return lib


def _python(code: str, env: dict[str, str] | None = None) -> Any:
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, **(env or {})})


CHECK = """
from trtbuild.backends.torch import cxx
from trtbuild.errors import TrtbuildError
print("SHADOWS", sorted(cxx.shadowing_libraries().items()))
try:
    cxx.check_symbols("graph.so")
    print("ACCEPTED")
except TrtbuildError as exc:
    print("REFUSED", exc, exc.hint)
"""


def shadowed(lib: Path) -> str:
    """libstdc++ loaded privately (as a dependency of an extension module is), then a library in the
    global scope that exports its facet ids: the H200 image's state once torch was imported."""
    return f"import ctypes, os\nctypes.CDLL('libstdc++.so.6')\nctypes.CDLL({str(lib)!r}, mode=os.RTLD_GLOBAL)\n"


def test_a_library_ahead_of_libstdcxx_is_named_and_the_graph_refused(shadow_lib: Path) -> None:
    proc = _python(shadowed(shadow_lib) + CHECK)
    assert proc.returncode == 0, proc.stderr
    assert "_ZNSt5ctypeIcE2idE" in proc.stdout and "_ZNSt7__cxx117collateIcE2idE" in proc.stdout
    assert "REFUSED graph.so" in proc.stdout and str(shadow_lib) in proc.stdout
    assert "import trtbuild before torch" in proc.stdout


def test_importing_trtbuild_first_keeps_libstdcxx_first(shadow_lib: Path) -> None:
    proc = _python(f"import trtbuild, ctypes, os\nctypes.CDLL({str(shadow_lib)!r}, mode=os.RTLD_GLOBAL)\n" + CHECK)
    assert proc.returncode == 0, proc.stderr
    assert "SHADOWS []" in proc.stdout and "ACCEPTED" in proc.stdout


class _Builder:
    """What `overlapped_objects` reads of Inductor's CppBuilder."""

    def __init__(self, name: str, compile_only: bool, out: str) -> None:
        self._name, self._compile_only, self._use_relative_path, self._output_dir = name, compile_only, False, out

    def get_command_line(self) -> str:
        return self._name


def test_the_wrapper_object_compiles_beside_the_kernels_and_the_link_waits_for_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AOTInductor's order (wrapper object, kernel object, link) with each compile a sleep: the kernels' compile
    starts while the wrapper's runs, the link only after it ended, and a failed wrapper is raised at the link."""
    import threading
    import time

    from torch._inductor import cpp_builder

    from trtbuild.backends.torch.cxx import overlapped_objects

    log: list[tuple[str, str, float]] = []
    lock = threading.Lock()

    def compile_cmd(cmd: str, cwd: str) -> None:
        with lock:
            log.append((cmd, "start", time.monotonic()))
        time.sleep(0.3)
        if "bad" in cmd:
            raise RuntimeError("wrapper.cpp: error")
        with lock:
            log.append((cmd, "end", time.monotonic()))

    monkeypatch.setattr(cpp_builder, "_run_compile_cmd", compile_cmd)
    monkeypatch.setattr(cpp_builder.CppBuilder, "build", lambda self: compile_cmd(self._name, ""))
    plain = cpp_builder.CppBuilder.build
    with overlapped_objects():
        for b in (_Builder("m.wrapper", True, str(tmp_path)), _Builder("m.kernel", True, str(tmp_path)),
                  _Builder("m.so", False, str(tmp_path))):
            cpp_builder.CppBuilder.build(b)  # type: ignore[arg-type]
    at = {(name, what): t for name, what, t in log}
    assert at[("m.kernel", "start")] < at[("m.wrapper", "end")]  # side by side
    assert at[("m.so", "start")] >= at[("m.wrapper", "end")]  # the link waited
    with pytest.raises(RuntimeError, match="wrapper.cpp"), overlapped_objects():
        cpp_builder.CppBuilder.build(_Builder("bad.wrapper", True, str(tmp_path)))  # type: ignore[arg-type]
        cpp_builder.CppBuilder.build(_Builder("bad.so", False, str(tmp_path)))  # type: ignore[arg-type]
    assert cpp_builder.CppBuilder.build is plain  # Inductor's own again
