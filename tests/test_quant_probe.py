"""benchmarks/probes/quant_probe.py on the CPU: it imports and parses without a GPU, its work list is the build's
own candidate lists for the Llama 1B and 8B decode shapes, and its parallel compile covers every launch it times."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "quant_probe.py"


def _probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quant_probe", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["quant_probe"] = module
    spec.loader.exec_module(module)
    return module


def test_the_probe_parses_its_defaults_and_refuses_batches_the_kernels_do_not_take() -> None:
    qp = _probe()
    args = qp.parse(["--out", "x"])
    assert (args.models, args.batches, args.formats, args.torchao) == (["1b", "8b"], [1, 8], ["int4", "fp8"], True)
    with pytest.raises(SystemExit):
        qp.parse(["--out", "x", "--batches", "32"])


def test_the_probe_times_the_builds_candidates_for_every_llama_decode_shape() -> None:
    pytest.importorskip("triton")  # the kernels' configuration lists import without it; the dense one does not
    from trtbuild.kernels.matmul_configs import MatmulConfig, quant_candidates

    qp = _probe()
    assert qp.shapes("1b") == {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
    assert qp.shapes("8b") == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    work = qp.plan(["1b", "8b"], [1, 8], ["int4", "fp8"], 132)
    assert len(work) == 2 * 4 * 2 * 3  # models x shapes x batches x (bf16, int4, fp8)
    for w in work:
        if w["format"] == "bf16":
            assert w["configs"] and all(MatmulConfig.parse(c).split == 1 for c in w["configs"])
        else:
            group = qp.GROUP if w["format"] == "int4" else 0
            assert w["configs"] == [c.name for c in quant_candidates(w["format"], w["rows"], w["n"], w["k"], group, 132)]
            assert w["configs"]
    # every timed (format, one row or more, configuration) has a compile launch of the same specialization
    keys = qp.compile_keys(work)
    covered = {(fmt, rows, name) for fmt, rows, _, name in keys}
    assert {(w["format"], 1 if w["rows"] == 1 else 2, c) for w in work for c in w["configs"]} == covered
    assert len(keys) < 150  # a few processes compile them within the probe's minutes
    # the floor: int4 reads half a byte a weight and 4 bytes a group of 128; each shape overflows the L2
    assert qp.quant_bytes("int4", 4096, 4096) == 4096 * 2048 + 4096 * 32 * 4
    assert qp.copies(qp.quant_bytes("int4", 2048, 2048), 16) * qp.quant_bytes("int4", 2048, 2048) >= qp.MIN_BYTES
