"""Recipes: closed, typed YAML documents, validated once, with every problem reported together.

A recipe is read into plain dataclasses. Validation walks the whole document, collects each problem
as `field.path: message` and raises one `RecipeError`; nothing is built from a recipe that did not
validate. Unknown keys are rejected with the closest known key suggested.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trtbuild import registry
from trtbuild.errors import InputError, RecipeError
from trtbuild.parallel import tp_problems

BACKENDS = ("torch", "tensorrt-llm", "tensorrt")
PRECISIONS = {
    # fp8, int8_wo, int4_wo: quantized weights, bf16 activations (models/quantize.py, docs/quantization.md)
    "torch": ("fp32", "fp16", "bf16", "fp8", "int8_wo", "int4_wo"),
    "tensorrt-llm": ("fp16", "bf16", "fp8", "int8_wo", "int4_wo", "int4_awq"),
    # "onnx": keep the ONNX file's own types (a strongly typed network; the only choice on TensorRT 11)
    "tensorrt": ("fp32", "fp16", "bf16", "fp8", "int8", "onnx"),
}
TACTIC_LEVELS = ("none", "default", "max")
# the families models/families.py reads (kept equal by a test; the recipe does not import the models)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe")
MOE_TYPES = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts"}  # and the field giving the experts' count
# \Z, not $: "$" also matches before a trailing newline, which would let "tiny\n" through.
NAME_RE = re.compile(r"^[a-z0-9._-]+\Z")
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")

# Fields of a synthetic model's config.json: name -> (type, required).
SYNTHETIC_FIELDS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "model_type": (str, True),
    "hidden_size": (int, True),
    "intermediate_size": (int, True),
    "num_hidden_layers": (int, True),
    "num_attention_heads": (int, True),
    "num_key_value_heads": (int, False),
    "head_dim": (int, False),
    "vocab_size": (int, True),
    "rms_norm_eps": ((int, float), False),
    "rope_theta": ((int, float), False),
    "rope_scaling": (dict, False),
    "tie_word_embeddings": (bool, False),
    "attention_bias": (bool, False),
    "mlp_bias": (bool, False),
    "max_position_embeddings": (int, False),
    "sliding_window": ((int, type(None)), False),
    "torch_dtype": (str, False),
    # the other families' fields (models/families.py says what each does)
    "hidden_act": (str, False),
    "hidden_activation": (str, False),
    "query_pre_attn_scalar": ((int, float), False),
    "attn_logit_softcapping": ((int, float, type(None)), False),
    "final_logit_softcapping": ((int, float, type(None)), False),
    "layer_types": (list, False),
    "sliding_window_pattern": (int, False),
    "rope_local_base_freq": ((int, float), False),
    "use_sliding_window": (bool, False),
    "num_local_experts": (int, False),
    "num_experts": (int, False),
    "num_experts_per_tok": (int, False),
    "moe_intermediate_size": (int, False),
    "norm_topk_prob": (bool, False),
    "decoder_sparse_step": (int, False),
    "mlp_only_layers": (list, False),
}


@dataclass(frozen=True)
class ModelSpec:
    source: str  # "synthetic", a hub repo id, a local folder or (tensorrt) an .onnx file, as written
    kind: str  # "synthetic" | "hub" | "local" | "onnx"
    path: Path | None  # resolved local folder or file, for kind local/onnx
    revision: str | None = None
    config: dict[str, Any] | None = None
    seed: int = 0


@dataclass(frozen=True)
class Shapes:
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    batch_buckets: tuple[int, ...]


@dataclass(frozen=True)
class RunDefaults:
    batch_size: int = 1
    input_len: int = 16
    output_len: int = 32


@dataclass(frozen=True)
class Parallel:
    tp: int = 1  # tensor-parallel ranks (GPUs of one host; processes on the CPU): docs/parallel.md


@dataclass(frozen=True)
class Recipe:
    name: str
    model: ModelSpec
    backend: str
    precision: str
    shapes: Shapes
    tactics_level: str
    run: RunDefaults
    options: dict[str, Any] = field(default_factory=dict)  # backend-specific, checked by the backend
    parallel: Parallel = field(default_factory=Parallel)
    path: Path | None = None  # the YAML file, for messages and relative paths

    def build_document(self) -> dict[str, Any]:
        """Everything in the recipe that can change the engine, as plain JSON-able data.

        The exclusion list is short on purpose (pip's cache key, not Torch-TensorRT's inclusion
        list): the recipe's name and its run defaults change nothing in the engine, and the model's
        location is replaced by the weights' identity in the key.
        """
        doc = _plain(dataclasses.asdict(self))
        for excluded in ("name", "run", "path"):
            doc.pop(excluded)
        if self.parallel == Parallel():
            doc.pop("parallel")  # one rank: the key of every engine built before the field existed
        doc["model"].pop("path")
        if self.model.kind in ("local", "onnx"):
            doc["model"].pop("source")  # where the folder lives is not what it holds
        return doc


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


class _Checker:
    """Collects problems as `field.path: message` while reading a document."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.problems.append(f"{where}: {message}")

    def mapping(self, value: Any, where: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.add(where or "(top level)", f"expected a mapping, got {_type_name(value)}")
            return {}
        for key in value:
            if not isinstance(key, str) or key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(allowed)}"
                self.add(_join(where, str(key)), f"unknown key{hint}")
        for key in required:
            if key not in value:
                self.add(_join(where, key), "required")
        return value

    def integer(self, value: Any, where: str, minimum: int = 1) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(where, f"expected an integer, got {_type_name(value)}")
            return None
        if value < minimum:
            self.add(where, f"must be >= {minimum}, got {value}")
            return None
        return value

    def choice(self, value: Any, where: str, choices: tuple[str, ...]) -> str | None:
        if not isinstance(value, str) or value not in choices:
            self.add(where, f"expected one of {', '.join(choices)}, got {value!r}")
            return None
        return value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file; raise `RecipeError` listing every problem found."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: recipe file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the recipe: {exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{path}: malformed YAML{where}: {problem}") from None
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        # PyYAML's constructors let these through for scalars it mis-resolves (`2001-13-01`,
        # `!!timestamp x`) and for very deep nesting.
        raise InputError(f"{path}: malformed YAML: {exc}") from None
    return parse_recipe(doc, path)


def parse_recipe(doc: Any, path: Path) -> Recipe:
    """Validate an already-parsed document as the recipe file `path`."""
    c = _Checker()
    top = c.mapping(doc, "", ("name", "model", "backend", "precision", "shapes", "tactics", "run", "options",
                              "parallel"),
                    required=("name", "model", "shapes"))

    name = top.get("name")
    if "name" in top and (not isinstance(name, str) or not NAME_RE.match(name)):
        c.add("name", f"must match [a-z0-9._-]+, got {name!r}")
        name = None

    backend = c.choice(top.get("backend", "torch"), "backend", BACKENDS)
    precision = top.get("precision", "fp32" if backend in (None, "torch") else "fp16")
    if backend is not None:
        precision = c.choice(precision, "precision", PRECISIONS[backend])

    model = _model(c, top.get("model"), path, backend) if "model" in top else None
    shapes = _shapes(c, top.get("shapes")) if "shapes" in top else None

    tactics = c.mapping(top.get("tactics", {}), "tactics", ("level",))
    level = c.choice(tactics.get("level", "default"), "tactics.level", TACTIC_LEVELS)

    run = _run(c, top.get("run", {}), shapes)
    parallel_ = _parallel(c, top.get("parallel", {}), model, backend)
    options = top.get("options", {})
    if not isinstance(options, dict):
        c.add("options", f"expected a mapping, got {_type_name(options)}")
        options = {}

    if model is not None and model.config is not None and shapes is not None:
        max_pos = model.config.get("max_position_embeddings")
        if isinstance(max_pos, int) and max_pos < shapes.max_seq_len:
            c.add("shapes.max_seq_len", f"{shapes.max_seq_len} exceeds model.config.max_position_embeddings ({max_pos})")

    if c.problems:
        raise RecipeError(str(path), c.problems)
    assert name and model and backend and precision and shapes and level and run  # all checked above
    recipe = Recipe(name=name, model=model, backend=backend, precision=precision, shapes=shapes,
                    tactics_level=level, run=run, options=dict(options), parallel=parallel_, path=path)
    problems = registry.check_recipe(recipe)  # the backend validates its own fields
    if problems:
        raise RecipeError(str(path), problems)
    return recipe


def _model(c: _Checker, value: Any, path: Path, backend: str | None) -> ModelSpec | None:
    m = c.mapping(value, "model", ("source", "revision", "config", "seed"), required=("source",))
    source = m.get("source")
    if "source" in m and (not isinstance(source, str) or not source):
        c.add("model.source", f"expected 'synthetic', a Hugging Face repo id or a folder, got {source!r}")
        return None
    if not isinstance(source, str):
        return None
    revision = m.get("revision")
    if revision is not None and not isinstance(revision, str):
        c.add("model.revision", f"expected a branch, tag or commit string, got {_type_name(revision)}")
    seed = m.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        c.add("model.seed", f"expected a non-negative integer, got {seed!r}")
        seed = 0

    if source == "synthetic":
        config = m.get("config")
        if config is None:
            c.add("model.config", "required when model.source is 'synthetic'")
            return None
        if revision is not None:
            c.add("model.revision", "only for Hugging Face hub sources")
        config = _synthetic_config(c, config)
        return ModelSpec(source=source, kind="synthetic", path=None, config=config, seed=seed)

    for key in ("config", "seed"):
        if key in m:
            c.add(f"model.{key}", "only for model.source 'synthetic'")
    try:
        # `~` expands before joining, so `~/models/x` means the home folder wherever the recipe lives.
        local = path.parent / Path(source).expanduser()
        is_file, is_dir = local.is_file(), local.is_dir()
    except (RuntimeError, OSError, ValueError) as exc:  # unknown ~user, a name too long, a NUL byte
        c.add("model.source", f"not a usable path: {exc}")
        return None
    if source.endswith(".onnx"):
        if not is_file:
            c.add("model.source", f"ONNX file not found: {local}")
        if backend != "tensorrt":
            c.add("model.source", "an .onnx model needs backend: tensorrt")
        return ModelSpec(source=source, kind="onnx", path=local.resolve())
    looks_local = source.startswith((".", "/", "~")) or is_dir
    if looks_local:
        if not is_dir:
            c.add("model.source", f"model folder not found: {local}")
        elif not (local / "config.json").is_file():
            c.add("model.source", f"{local} has no config.json; expected a Hugging Face-format folder")
        if revision is not None:
            c.add("model.revision", "only for Hugging Face hub sources")
        return ModelSpec(source=source, kind="local", path=local.resolve())
    if REPO_ID_RE.match(source):
        return ModelSpec(source=source, kind="hub", path=None, revision=revision)
    c.add("model.source", f"{source!r} is neither 'synthetic', an existing folder nor a repo id 'org/name'")
    return None


def _synthetic_config(c: _Checker, value: Any) -> dict[str, Any] | None:
    where = "model.config"
    cfg = c.mapping(value, where, tuple(SYNTHETIC_FIELDS),
                    required=tuple(k for k, (_, req) in SYNTHETIC_FIELDS.items() if req))
    if not cfg:
        return None
    # each field present is checked even when others are missing (reported above): every problem at once;
    # the checks across fields, after this loop, need them all
    ok = all(k in cfg for k, (_, req) in SYNTHETIC_FIELDS.items() if req)
    for key, (kind, _) in SYNTHETIC_FIELDS.items():
        if key in cfg:
            v = cfg[key]
            bad_bool = isinstance(v, bool) and kind is not bool
            if bad_bool or not isinstance(v, kind):
                c.add(f"{where}.{key}", f"expected {getattr(kind, '__name__', 'a number')}, got {_type_name(v)}")
                ok = False
            elif isinstance(v, int) and not isinstance(v, bool) and v <= 0 and key != "sliding_window":
                c.add(f"{where}.{key}", f"must be > 0, got {v}")
                ok = False
    if not ok:
        return None
    if "rope_scaling" in cfg:
        _rope_scaling(c, cfg["rope_scaling"], f"{where}.rope_scaling")
    if cfg["model_type"] not in MODEL_TYPES:
        c.add(f"{where}.model_type", f"expected one of {', '.join(MODEL_TYPES)}, got {cfg['model_type']!r}")
    _family_fields(c, cfg, where)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv = cfg.get("num_key_value_heads", heads)
    if "head_dim" not in cfg and hidden % heads:
        c.add(f"{where}.num_attention_heads", f"{heads} does not divide hidden_size {hidden}")
    if heads % kv:
        c.add(f"{where}.num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    head_dim = cfg.get("head_dim", hidden // heads if heads else 0)
    if head_dim % 2:
        c.add(f"{where}.head_dim" if "head_dim" in cfg else f"{where}.hidden_size",
              f"the head dimension {head_dim} must be even for rotary embeddings")
    return dict(cfg)


def _family_fields(c: _Checker, cfg: dict[str, Any], where: str) -> None:
    """What a family needs of its fields, and the values trtbuild implements (models/families.py)."""
    kind = cfg["model_type"]
    gemma = kind in ("gemma2", "gemma3_text")
    act_key = "hidden_activation" if gemma else "hidden_act"
    allowed = "gelu_pytorch_tanh" if gemma else "silu"
    for key in ("hidden_act", "hidden_activation"):
        if key in cfg and (key != act_key or cfg[key] != allowed):
            c.add(f"{where}.{key}", f"{kind} takes only {act_key}: {allowed}, got {key}: {cfg[key]!r}")
    if kind in MOE_TYPES:
        count = MOE_TYPES[kind]
        if count not in cfg:
            c.add(f"{where}.{count}", f"required for {kind} (the number of experts)")
        elif not 0 < cfg.get("num_experts_per_tok", 2) <= cfg[count]:
            c.add(f"{where}.num_experts_per_tok", f"must be between 1 and {count} ({cfg[count]})")
        if kind == "qwen3_moe" and "moe_intermediate_size" not in cfg:
            c.add(f"{where}.moe_intermediate_size", "required for qwen3_moe (each expert's MLP width)")
    moe_only = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers")
    gemma_only = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window_pattern",
                  "rope_local_base_freq")
    for key in cfg:
        if (key in moe_only and kind not in MOE_TYPES) or (key in gemma_only and not gemma):
            c.add(f"{where}.{key}", f"not a field of {kind}")
    if kind == "gemma3_text" and cfg.get("attn_logit_softcapping") is not None:
        c.add(f"{where}.attn_logit_softcapping", "Gemma 3 does not cap its attention scores; leave it out")
    types = cfg.get("layer_types")
    if types is not None and (len(types) != cfg["num_hidden_layers"]
                              or not set(types) <= {"full_attention", "sliding_attention"}):
        c.add(f"{where}.layer_types", "expected one of full_attention, sliding_attention for each of the "
              f"{cfg['num_hidden_layers']} layers")


ROPE_SCALING_FIELDS = {"default": (), "linear": ("factor",),
                       "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _rope_scaling(c: _Checker, value: dict[str, Any], where: str) -> None:
    """The rope types the model implements, with the numbers each needs (else a KeyError at build time)."""
    kind = value.get("rope_type", value.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_SCALING_FIELDS:
        c.add(f"{where}.rope_type", f"expected one of {', '.join(ROPE_SCALING_FIELDS)}, got {kind!r}")
        return
    for key in ROPE_SCALING_FIELDS[kind]:
        v = value.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            c.add(f"{where}.{key}", f"a positive number is required for rope_type {kind}, got {v!r}")
    if kind == "llama3" and all(isinstance(value.get(k), (int, float)) for k in ("low_freq_factor", "high_freq_factor")) \
            and value["high_freq_factor"] <= value["low_freq_factor"]:
        c.add(f"{where}.high_freq_factor", "must exceed low_freq_factor")


def _shapes(c: _Checker, value: Any) -> Shapes | None:
    s = c.mapping(value, "shapes", ("max_batch_size", "max_input_len", "max_seq_len", "batch_buckets"),
                  required=("max_batch_size", "max_input_len", "max_seq_len"))
    mb = c.integer(s.get("max_batch_size"), "shapes.max_batch_size") if "max_batch_size" in s else None
    mi = c.integer(s.get("max_input_len"), "shapes.max_input_len") if "max_input_len" in s else None
    ms = c.integer(s.get("max_seq_len"), "shapes.max_seq_len", minimum=2) if "max_seq_len" in s else None
    if mi is not None and ms is not None and mi > ms:
        c.add("shapes.max_input_len", f"{mi} exceeds shapes.max_seq_len {ms}")
    buckets: tuple[int, ...] | None = (mb,) if mb else None
    if "batch_buckets" in s:
        raw = s["batch_buckets"]
        if not isinstance(raw, list) or not raw:
            c.add("shapes.batch_buckets", f"expected a non-empty list of integers, got {raw!r}")
            buckets = None
        else:
            got = [c.integer(b, f"shapes.batch_buckets[{i}]") for i, b in enumerate(raw)]
            if any(b is None for b in got):
                buckets = None
            else:
                vals = [b for b in got if b is not None]
                if len(set(vals)) != len(vals):
                    c.add("shapes.batch_buckets", f"buckets repeat: {vals}")
                if mb is not None and max(vals) > mb:
                    c.add("shapes.batch_buckets", f"bucket {max(vals)} exceeds shapes.max_batch_size {mb}")
                if mb is not None and max(vals) < mb:
                    c.add("shapes.batch_buckets", f"the largest bucket ({max(vals)}) must equal shapes.max_batch_size {mb}, "
                          "or batches up to max_batch_size would have no engine")
                buckets = tuple(sorted(set(vals)))
    if mb is None or mi is None or ms is None or buckets is None:
        return None
    return Shapes(max_batch_size=mb, max_input_len=mi, max_seq_len=ms, batch_buckets=buckets)


def _parallel(c: _Checker, value: Any, model: ModelSpec | None, backend: str | None) -> Parallel:
    """`parallel: {tp: N}`: tp must split the model's attention heads, KV heads and MLP evenly, checked here
    where the config is at hand (a synthetic model's, a local folder's config.json); a hub model's at build."""
    p = c.mapping(value, "parallel", ("tp",))
    tp = c.integer(p.get("tp", 1), "parallel.tp") if "tp" in p else 1
    if tp is None or tp == 1:
        return Parallel()
    if backend == "tensorrt":
        c.add("parallel.tp", "backend tensorrt builds one plan for one GPU; use torch or tensorrt-llm for tp > 1")
    cfg: Any = None
    source = "model.config"
    if model is not None and model.kind == "synthetic":
        cfg = model.config
    elif model is not None and model.kind == "local" and model.path is not None:
        source = str(model.path / "config.json")
        try:
            cfg = json.loads((model.path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cfg = None  # the build reports the unreadable config.json
    if isinstance(cfg, dict):
        heads = cfg.get("num_attention_heads")
        kv = cfg.get("num_key_value_heads") or heads
        mlp = cfg.get("intermediate_size")
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (heads, kv, mlp)):
            for problem in tp_problems(heads, kv, mlp, tp, source):
                field, _, message = problem.partition(": ")
                c.add(field, message)
    return Parallel(tp=tp)


def _run(c: _Checker, value: Any, shapes: Shapes | None) -> RunDefaults | None:
    r = c.mapping(value, "run", ("batch_size", "input_len", "output_len"))
    defaults = RunDefaults()
    bs = c.integer(r.get("batch_size", defaults.batch_size), "run.batch_size")
    il = c.integer(r.get("input_len", defaults.input_len), "run.input_len")
    if il is not None and shapes is not None and "input_len" not in r:
        # a default the user did not write must fit the recipe's shapes: never an error about a field
        # that is not in the file
        il = max(1, min(il, shapes.max_input_len, shapes.max_seq_len - 1))
    ol = c.integer(r.get("output_len", defaults.output_len), "run.output_len")
    if ol is not None and il is not None and shapes is not None and "output_len" not in r:
        ol = max(1, min(ol, shapes.max_seq_len - il))
    if bs is None or il is None or ol is None:
        return None
    if shapes is not None:
        for field, msg in run_shape_problems(shapes, bs, il, ol):
            c.add(f"run.{field}", msg if field in r else f"{msg} (the default: the recipe sets no run.{field})")
    return RunDefaults(batch_size=bs, input_len=il, output_len=ol)


def run_shape_problems(shapes: Shapes, batch_size: int, input_len: int, output_len: int) -> list[tuple[str, str]]:
    """Why a run of this size does not fit the engine's shapes; shared by recipes and CLI flags."""
    problems = [(field, f"must be >= 1, got {v}") for field, v in
                (("batch_size", batch_size), ("input_len", input_len), ("output_len", output_len)) if v < 1]
    if batch_size > shapes.max_batch_size:
        problems.append(("batch_size", f"{batch_size} exceeds shapes.max_batch_size {shapes.max_batch_size}"))
    if input_len > shapes.max_input_len:
        problems.append(("input_len", f"{input_len} exceeds shapes.max_input_len {shapes.max_input_len}"))
    if input_len + output_len > shapes.max_seq_len:
        problems.append(("output_len", f"input_len + output_len = {input_len + output_len} exceeds "
                         f"shapes.max_seq_len {shapes.max_seq_len}"))
    return problems
