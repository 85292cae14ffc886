"""Fixtures that install the strict doubles into sys.modules for one test (monkeypatch), never globally."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.doubles import tiny_onnx
from tests.doubles.fake_tensorrt import make_tensorrt


@pytest.fixture
def install_trt(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """install_trt("10.x" | "10.16" | "11.1", compute_capability="9.0") -> the fake module, as `tensorrt`."""

    def install(flavour: str = "10.16", compute_capability: str = "9.0") -> Any:
        mod = make_tensorrt(flavour, compute_capability)
        monkeypatch.setitem(sys.modules, "tensorrt", mod)
        return mod

    return install


@pytest.fixture
def install_trtllm(monkeypatch: pytest.MonkeyPatch, install_trt: Callable[..., Any]) -> Callable[..., Any]:
    """install_trtllm("0.13" | "1.0" | "1.2" | "1.3") -> the fake package (with a 10.x tensorrt beside it)."""
    from tests.doubles.fake_tensorrt_llm import make_tensorrt_llm

    def install(flavour: str = "1.2", gpus: int = 8, trt_flavour: str = "10.16") -> Any:
        trt = install_trt(trt_flavour)
        modules = make_tensorrt_llm(flavour, gpus=gpus)
        for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
            monkeypatch.delitem(sys.modules, name)
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        modules["tensorrt_llm"]._fake_trt = trt
        return modules["tensorrt_llm"]

    return install


@pytest.fixture
def onnx_recipe(tmp_path: Path) -> Callable[..., Path]:
    """A recipe for backend tensorrt beside a generated .onnx file; keyword arguments override fields."""

    def make(model: bytes | None = None, **overrides: Any) -> Path:
        (tmp_path / "model.onnx").write_bytes(model if model is not None else tiny_onnx.lm())
        doc: dict[str, Any] = {
            "name": "onnx-lm", "model": {"source": "model.onnx"}, "backend": "tensorrt", "precision": "fp16",
            "shapes": {"max_batch_size": 4, "max_input_len": 8, "max_seq_len": 16, "batch_buckets": [1, 4]},
            "tactics": {"level": "default"}, "run": {"batch_size": 1, "input_len": 4, "output_len": 4},
        }
        doc.update(overrides)
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    return make
