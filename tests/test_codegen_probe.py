"""The quantized decode kernel's one-row loops as compiled for an H100, read on the CPU through
benchmarks/probes/codegen_probe.py: no barrier inside the loop (before, int4 moved x through shared memory and
fp8/int8 summed across threads every step, with barriers each time), and stages that compile to the same code
(what lets the build time one of each pair)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("triton")
PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "codegen_probe.py"


def _probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("codegen_probe", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["codegen_probe"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("fmt", "gate"), [("int4", False), ("int4", True), ("fp8", False), ("int8", True)])
def test_the_one_row_loop_has_no_barrier_and_its_stages_compile_alike(fmt: str, gate: bool) -> None:
    cp = _probe()
    try:
        row = cp.probe(fmt, "n4k1024w4s1", 1, gate, stages=True)
    except (FileNotFoundError, RuntimeError) as e:  # a Triton without its NVIDIA tools cannot compile here
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    assert row["loop_instructions"] > 0 and row["loop_loads"] > 0
    assert row["loop_barriers"] == 0 and row["loop_shared_moves"] == 0, row
    assert row["stack_bytes"] == 0
    assert row["same_code_as_n4k1024w4s3"] is True
