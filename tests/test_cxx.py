"""One libstdc++ for compiled graphs: the condition that crashed every graph on the H200 image, made
here with a tiny library that exports two of libstdc++'s locale facet ids (trtbuild/backends/torch/cxx.py)."""

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
