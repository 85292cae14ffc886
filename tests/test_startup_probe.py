"""benchmarks/probes/startup_probe.py, run here before device time goes to it: its rows come from new
processes, its parse of `python -X importtime` and its bytecode census are right."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "probes"))
import startup_probe  # noqa: E402


def test_the_slowest_imports_are_ranked_by_their_own_time_not_their_childrens() -> None:
    stderr = ("import time: self [us] | cumulative | imported package\n"
              "import time:       120 |        120 |   torch._utils\n"
              "import time:    190000 |     250000 |   torch._C\n"
              "import time:     15000 |     973000 | torch\n")
    got = startup_probe.slowest_imports(stderr, top=2)
    assert got["modules"] == 3 and abs(got["self_s_total"] - 0.20512) < 1e-9
    assert [r["module"] for r in got["slowest"]] == ["torch._C", "torch"]
    assert got["slowest"][1]["cumulative_s"] == 0.973


def test_the_census_counts_the_modules_whose_bytecode_is_missing(tmp_path: Path) -> None:
    import importlib.util
    import py_compile

    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.py").write_text("x = 1\n")
    py_compile.compile(str(tmp_path / "a.py"), cfile=importlib.util.cache_from_source(str(tmp_path / "a.py")))
    got = startup_probe.bytecode_census(tmp_path)
    assert (got["py_files"], got["with_bytecode"], got["package_writable"]) == (3, 1, True)


def test_the_probe_times_each_start_up_in_new_processes_on_the_cpu(tmp_path: Path) -> None:
    out = startup_probe.probe(repeats=1, native=False, device="cpu")
    assert list(out["rows"]) == ["python -c pass", "libtorch's libraries alone (ctypes)", "import torch",
                                 "import torch, fresh PYTHONPYCACHEPREFIX (compiles)",
                                 "import torch, that prefix again (reads it)"]
    assert all(s > 0 for s in out["rows"].values())
    assert out["rows"]["python -c pass"] < out["rows"]["import torch"]
    assert out["importtime"]["modules"] > 100 and out["importtime"]["slowest"][0]["self_s"] > 0
    assert out["bytecode"]["py_files"] > 1000
    assert all(name in startup_probe.table(out) for name in out["rows"])
