"""Shared fixtures: every test gets its own engine store; tiny Hugging Face-format models are made here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

# pytest-xdist's workers, as many as the cores: with torch's default of a thread a core each, twice as many
# threads as cores, and a small op's threads wait on each other's time slices (the tiny GPTQ tests took 30-150
# s beside SmolLM2's quality tests, 2-5 s alone). One thread a worker, and for the processes it starts.
if os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (os.cpu_count() or 1):
    os.environ["OMP_NUM_THREADS"] = "1"

import trtbuild  # noqa: F401,E402  - before torch, as a user's process would (trtbuild/backends/torch/cxx.py)

REPO = Path(__file__).resolve().parent.parent

TINY_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 64,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "needs_tensorrt" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs the real TensorRT / TensorRT-LLM and a GPU"))
    # the longest files first: `pytest -n 2 --dist loadfile` hands files out in this order, so their minutes run
    # beside the other worker's many files rather than alone at the end (CI: 24 minutes of tests with it last)
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


# the two longest files, one to each worker at the start: SmolLM2's GPTQ calibrations and perplexities (~7-9
# minutes on 2 cores) and the gate's CPU smoke run (~5 minutes), which otherwise may come last, alone
FIRST = ("test_quality.py", "test_gate.py")


@pytest.fixture(autouse=True)
def engine_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the default engine store at a fresh folder, so no test sees another's engines."""
    store = tmp_path / "engines"
    monkeypatch.setenv("TRTBUILD_ENGINES", str(store))
    monkeypatch.delenv("TRTBUILD_NO_BUILD", raising=False)
    monkeypatch.delenv("TRTBUILD_DEBUG", raising=False)
    return store


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """A safetensors file of every kind of tensor the weight readers meet: bf16 spanning many small chunks,
    fp32, int64, bool, a scalar and an empty tensor."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "big.bf16": torch.randn(300, 257, generator=g).to(torch.bfloat16),  # spans many 1-4 KB chunks
        "mid.f32": torch.randn(33, 7, generator=g),
        "ids.i64": torch.arange(-50, 50),
        "flag.bool": torch.tensor([True, False, True]),
        "scalar.f16": torch.tensor(1.5, dtype=torch.float16),
        "empty.f32": torch.zeros(0, 4),
    }
    path = tmp_path / "weights.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def write_recipe(folder: Path, doc: dict[str, Any], name: str = "recipe.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def tiny_recipe_doc(**overrides: Any) -> dict[str, Any]:
    """A synthetic recipe small enough to export and compile on 2 CPU cores in seconds."""
    doc: dict[str, Any] = {
        "name": "tiny",
        "model": {"source": "synthetic", "seed": 0, "config": dict(TINY_CONFIG)},
        "backend": "torch",
        "precision": "fp32",
        "shapes": {"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [2]},
        "tactics": {"level": "none"},
        "run": {"batch_size": 1, "input_len": 8, "output_len": 8},
    }
    doc.update(overrides)
    return doc


def make_hf_folder(folder: Path, config: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """A real Hugging Face-format checkpoint (config.json + model.safetensors) with seeded weights."""
    from trtbuild.models.checkpoint import write_synthetic

    write_synthetic(folder, dict(config or TINY_CONFIG), seed)
    return folder


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    """The real `trtbuild` command in a new process."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "trtbuild", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO, timeout=900)


def read_json_line(stdout: str) -> Any:
    return json.loads(stdout.strip().splitlines()[-1])


def run_compiled_triton(script: Path) -> None:
    """Run a test script in a process of its own with Triton's interpreter off (export traces a Triton op's
    kernel launch only there), the checkout and wherever Triton was found (a --target folder in the CPU
    instructions) on its path; it must end by printing "ok"."""
    import subprocess

    import triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(triton.__file__).resolve().parents[1])])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def random_tiny_model(max_batch_size: int, max_seq_len: int = 96) -> Any:
    """TINY_CONFIG's eager Transformer in fp32, its weights seeded normal with std 0.2, in eval mode."""
    import torch

    from trtbuild.models.llama import LlamaConfig, Transformer

    torch.manual_seed(0)
    cfg = LlamaConfig.from_hf(dict(TINY_CONFIG))
    model = Transformer(cfg, max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()
