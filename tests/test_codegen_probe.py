"""The quantized decode kernel's one-row loops as compiled for an H100, read on the CPU through
benchmarks/probes/codegen_probe.py: no barrier inside the loop (before, int4 moved x through shared memory and
fp8/int8 summed across threads every step, with barriers each time), no spill, and stages that compile to the
same code (what lets the build time one of each pair)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_the_one_row_loops_have_no_barrier_and_their_stages_compile_alike(tmp_path: Path) -> None:
    # a process of its own, Triton's interpreter off: other test modules turn it on in this one
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(triton.__file__).resolve().parents[1])])
    proc = subprocess.run([sys.executable, "benchmarks/probes/codegen_probe.py", "--formats", "int4", "int8", "fp8",
                           "--configs", "n4k1024w4s1", "--gate", "--stages", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "codegen_probe.json").read_text())["rows"]
    if all("error" in r for r in rows):  # a Triton without its NVIDIA tools cannot compile for sm_90 here
        pytest.skip(rows[0]["error"])
    assert len(rows) == 6 and not any("error" in r for r in rows), rows
    for r in rows:
        assert r["loop_instructions"] > 0 and r["loop_loads"] > 0, r
        assert r["loop_barriers"] == 0 and r["loop_shared_moves"] == 0 and r["stack_bytes"] == 0, r
        assert r["same_code_as_n4k1024w4s3"] is True, r
