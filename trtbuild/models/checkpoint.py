"""Hugging Face-format model folders: read config.json and safetensors, write seeded synthetic ones, and
map a checkpoint's tensors onto the model's fused layout (`convert_hf_state_dict`).

Every problem names the file and the field or tensor: a folder that does not load is the user's to
fix, so it is an `InputError`, never a traceback from deep inside safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trtbuild.errors import InputError
from trtbuild.models.families import ARCHITECTURES, FAMILIES, refused_fields
from trtbuild.models.family_weights import convert_family, family_shapes
from trtbuild.models.llama import LlamaConfig, rope_frequencies

WEIGHT_INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def hf_parameter_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a Hugging Face checkpoint of this config must hold, with their shapes."""
    d = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        shapes.update(family_shapes(cfg, i))
    return shapes


def read_config(folder: Path) -> tuple[dict[str, Any], LlamaConfig]:
    """config.json read and checked: InputError with every problem it has, each as `path: field: message`."""
    raw, cfg, problems = _config_problems(folder)
    if problems or raw is None or cfg is None:
        raise _all(folder, problems)
    return raw, cfg


def _all(folder: Path, problems: list[str]) -> InputError:
    """One problem as it is; several together, one a line, as a recipe's are reported."""
    if len(problems) == 1:
        return InputError(problems[0])
    return InputError(f"{folder}: {len(problems)} problems in the model folder:\n" + "\n".join(f"  {p}" for p in problems))


def _config_problems(folder: Path) -> tuple[dict[str, Any] | None, LlamaConfig | None, list[str]]:
    """config.json's contents, the config made from it (None when it cannot be made), and every problem found:
    later checks run whenever the earlier ones leave something to check."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None, [f"{path}: not found; a model folder needs config.json"]
    except (OSError, UnicodeDecodeError) as exc:
        return None, None, [f"{path}: cannot read: {exc}"]
    except json.JSONDecodeError as exc:
        return None, None, [f"{path}: not valid JSON (truncated?) at line {exc.lineno}, column {exc.colno}: {exc.msg}"]
    if not isinstance(raw, dict):
        return None, None, [f"{path}: expected a JSON object"]
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        return raw, None, [f"{path}: model_type: {model_type!r} is not supported ({', '.join(FAMILIES)} are)"]
    problems = [f"{path}: {r}" for r in refused_fields(raw)]
    try:
        cfg = LlamaConfig.from_hf(raw)
    except KeyError as exc:
        return raw, None, [*problems, f"{path}: {exc.args[0]}: required field missing"]
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        return raw, None, [*problems, f"{path}: a field has the wrong type or value: {exc}"]
    try:
        rope_frequencies(cfg)  # an unsupported or incomplete rope_scaling fails here, not mid-build
    except KeyError as exc:
        problems.append(f"{path}: rope_scaling.{exc.args[0]}: required field missing")
    except (TypeError, ValueError) as exc:
        problems.append(f"{path}: rope_scaling: {exc}")
    if cfg.num_heads % cfg.num_kv_heads:
        problems.append(f"{path}: num_key_value_heads: {cfg.num_kv_heads} does not divide num_attention_heads "
                        f"{cfg.num_heads}")
    if cfg.num_experts and not 0 < cfg.experts_per_token <= cfg.num_experts:
        problems.append(f"{path}: num_experts_per_tok: {cfg.experts_per_token} must be between 1 and the "
                        f"{cfg.num_experts} experts")
    return raw, cfg, problems


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, through its index when it is sharded."""
    index = folder / WEIGHT_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InputError(f"{index}: weight_map: cannot read the shard index: {exc}") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise InputError(f"{index}: weight_map names shard(s) that are not in the folder: {', '.join(missing)}",
                             hint="an interrupted download? fetch the model again")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError(f"{folder}: no *.safetensors weight files", hint="trtbuild reads safetensors checkpoints only")
    return files


def load_weights(folder: Path, cfg: LlamaConfig, dtype: torch.dtype, device: str = "cpu") -> dict[str, Tensor]:
    """Every tensor the config needs, checked for presence and shape, cast to `dtype`."""
    from safetensors import SafetensorError, safe_open

    expected = hf_parameter_shapes(cfg)
    found: dict[str, Tensor] = {}
    where: dict[str, Path] = {}
    for file in weight_files(folder):
        try:
            with safe_open(str(file), framework="pt", device=device) as f:
                for name in f.keys():
                    if name in expected:
                        found[name] = f.get_tensor(name)
                        where[name] = file
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise InputError(f"{file}: not a readable safetensors file (truncated or corrupt?): {exc}") from None
    missing = [n for n in expected if n not in found]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise InputError(f"{folder}: tensor(s) missing from the checkpoint: {shown}")
    for name, shape in expected.items():
        if tuple(found[name].shape) != shape:
            raise InputError(f"{where[name]}: tensor {name} has shape {tuple(found[name].shape)}, "
                             f"config.json implies {shape}")
    return {name: t.to(dtype) for name, t in found.items()}


def synthetic_checkpoint(config: dict[str, Any], seed: int) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """config.json's contents and the seeded random weights of a synthetic model, in memory.

    Each tensor is drawn in fp32 on the CPU by a generator of its own, seeded from `seed` and the tensor's
    name, so the same (config, seed) gives the same numbers on every machine, and the tensors are drawn on
    all of the host's cores at once (one generator drew an 8B model's 8 billion numbers in about 40 s, one
    after the other). Norms start at one.
    """
    from concurrent.futures import ThreadPoolExecutor

    raw = {"architectures": [ARCHITECTURES.get(config.get("model_type", "llama"), "LlamaForCausalLM")],
           "torch_dtype": "float32", **config}
    cfg = LlamaConfig.from_hf(raw)
    dtype = DTYPES.get(raw["torch_dtype"])
    if dtype is None:
        raise InputError(f"model.config.torch_dtype: expected one of {', '.join(DTYPES)}, got {raw['torch_dtype']!r}")

    def draw(item: tuple[str, tuple[int, ...]]) -> Tensor:
        name, shape = item
        if name.endswith("norm.weight"):  # a unit gain: stored as 0 where the family stores gain - 1 (Gemma)
            return torch.full(shape, 0.0 if cfg.unit_offset_norms else 1.0, dtype=dtype)
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8],
                                                           "little") >> 1)
        std = 0.02 if name.endswith(".bias") or "embed" in name else 1.0 / (shape[-1] ** 0.5)
        return (torch.randn(shape, generator=gen) * std).to(dtype)

    shapes = list(hf_parameter_shapes(cfg).items())
    # torch's kernels let go of the GIL: threads draw side by side
    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        tensors = dict(zip((name for name, _ in shapes), pool.map(draw, shapes), strict=True))
    return raw, tensors


def write_synthetic(folder: Path, config: dict[str, Any], seed: int) -> None:
    """Write config.json + model.safetensors of `synthetic_checkpoint`, as a real checkpoint would be."""
    from safetensors.torch import save_file

    raw, tensors = synthetic_checkpoint(config, seed)
    folder.mkdir(parents=True, exist_ok=True)
    write_config(folder, raw)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_config(folder: Path, raw: dict[str, Any]) -> None:
    """config.json as a checkpoint holds it, written whole or not at all."""
    from trtbuild.store.tactics import write_atomic

    write_atomic(folder / "config.json", (json.dumps(raw, indent=2, sort_keys=True) + "\n").encode())


def convert_hf_state_dict(hf: dict[str, Tensor], cfg: LlamaConfig) -> dict[str, Tensor]:
    """Hugging Face parameter names → this module's fused layout. Raises KeyError naming a missing tensor."""
    out: dict[str, Tensor] = {"tok_embeddings.weight": hf["model.embed_tokens.weight"],
                              "norm.weight": hf["model.norm.weight"]}
    out["output.weight"] = hf["model.embed_tokens.weight"] if cfg.tie_word_embeddings else hf["lm_head.weight"]
    return convert_family(hf, cfg, out)


def header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from a safetensors file's header alone (8 bytes of length, then JSON): what
    `trtbuild validate` checks without reading any weights."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= 100_000_000:
                raise ValueError(f"header length {length} is not plausible")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as exc:
        raise InputError(f"{file}: not a readable safetensors file (truncated or corrupt?): {exc}") from None
    return {name: tuple(info["shape"]) for name, info in header.items()
            if name != "__metadata__" and isinstance(info, dict) and "shape" in info}


def check_folder(folder: Path) -> None:
    """What a build would refuse in a local model folder, found from config.json and the weights' headers, every
    problem at once: the config's fields, every tensor it implies (present, with its shape), and tensors of layers
    the config does not have (a num_hidden_layers that does not match the weights)."""
    _, cfg, problems = _config_problems(folder)
    if cfg is not None:
        problems += _weight_problems(folder, cfg)
    if problems:
        raise _all(folder, problems)


def _weight_problems(folder: Path, cfg: LlamaConfig) -> list[str]:
    expected = hf_parameter_shapes(cfg)
    found: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    try:
        for file in weight_files(folder):
            for name, shape in header_shapes(file).items():
                found[name], where[name] = shape, file
    except InputError as exc:  # no weights, or unreadable ones: nothing more to compare
        return [str(exc)]
    problems = []
    layers = {int(n.split(".")[2]) for n in found if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if layers and max(layers) + 1 != cfg.num_layers:
        problems.append(f"{folder / 'config.json'}: num_hidden_layers: {cfg.num_layers}, but the weights hold "
                        f"{max(layers) + 1} layers (model.layers.0 to model.layers.{max(layers)})")
    missing = [n for n in expected if n not in found]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        problems.append(f"{folder}: tensor(s) missing from the checkpoint: {shown}")
    wrong = [(name, shape) for name, shape in expected.items() if name in found and found[name] != shape]
    for name, shape in wrong[:5]:  # one field usually explains them all: the first few are enough to see which
        problems.append(f"{where[name]}: tensor {name} has shape {found[name]}, config.json implies {shape}")
    if len(wrong) > 5:
        problems.append(f"{folder}: and {len(wrong) - 5} more tensor(s) whose shapes disagree with config.json")
    return problems
