"""Which backends exist, where their code lives and how to install their library: a table, and the
lazy import of a backend's module.

A leaf: the recipe's validation asks a backend to check its own fields through here without importing
any backend module up front (backends/__init__.py holds the protocol every backend implements).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from trtbuild.errors import BackendUnavailableError


@dataclass(frozen=True)
class _Registration:
    module: str
    cls: str
    install: str  # the install step shown when the backend is unavailable


REGISTRY: dict[str, _Registration] = {
    "torch": _Registration("trtbuild.backends.torch.backend", "TorchAOTIBackend",
                           "pip install torch (a CUDA build for GPUs)"),
    "tensorrt-llm": _Registration("trtbuild.backends.tensorrt.llm", "TensorRTLLMBackend",
                                  "install tensorrt_llm from NVIDIA's Python package index, as NVIDIA's "
                                  "TensorRT-LLM installation guide describes (pip's default index has only a placeholder)"),
    "tensorrt": _Registration("trtbuild.backends.tensorrt.onnx_plan", "TensorRTBackend",
                              "install tensorrt from NVIDIA's Python package index, as NVIDIA's TensorRT "
                              "installation guide describes (pip's default index has only a placeholder)"),
}


def backend(name: str) -> Any:
    """An instance of the backend registered as `name` (its module imported now, its library later)."""
    reg = REGISTRY[name]
    try:
        module = importlib.import_module(reg.module)
    except ModuleNotFoundError as exc:
        if exc.name != reg.module:
            raise
        raise BackendUnavailableError(f"backend '{name}' is not part of this trtbuild yet",
                                      hint="choose backend: torch") from None
    return getattr(module, reg.cls)()


def check_recipe(recipe: Any) -> list[str]:
    """The backend's own checks of a recipe (a `recipe.Recipe`) that passed the common schema."""
    try:
        chosen = backend(recipe.backend)
    except BackendUnavailableError as exc:
        return [f"backend: {exc}"]
    problems: list[str] = chosen.check(recipe)
    return problems
