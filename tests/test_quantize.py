"""Quantized weights: formats and round trips, GPTQ against round to nearest, the model's quantized Linear,
recipes and keys, the build step, and `trtbuild eval` (perplexity and agreement) on tiny models."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trtbuild.errors import RecipeError
from trtbuild.models import calibrate, gptq, quantize
from trtbuild.recipe import load_recipe

from .conftest import TINY_CONFIG, make_hf_folder, read_json_line, run_cli, tiny_recipe_doc, write_recipe


def _weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: per-channel scales must follow them
    return torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]


@pytest.mark.parametrize("k, group", [(256, 128), (576, 64), (1536, 128), (96, 32)])
def test_int4_group_is_the_largest_of_128_64_32_dividing_the_width(k: int, group: int) -> None:
    assert quantize.group_size(k) == group
    assert quantize.stored_shapes("int4", 8, k)["scale"][0] == (8, k // group)


def test_a_width_no_group_divides_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize.group_size(48)


def test_int4_packing_is_split_halves_within_each_group_and_inverts() -> None:
    q = torch.randint(0, 16, (3, 128), dtype=torch.uint8)
    packed = quantize.pack_int4(q, 64)
    assert packed.shape == (3, 64) and packed.dtype == torch.uint8
    # byte i of a group: column i in the low nibble, column i + 32 in the high one
    assert int(packed[1, 5]) == int(q[1, 5]) | (int(q[1, 37]) << 4)
    assert int(packed[2, 32 + 7]) == int(q[2, 64 + 7]) | (int(q[2, 64 + 32 + 7]) << 4)
    assert torch.equal(quantize.unpack_int4(packed, 64), q)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_round_trip_error_is_within_half_a_step_of_each_format(fmt: str) -> None:
    w = _weight()
    stored = quantize.quantize(fmt, w)
    back = quantize.dequantize(fmt, stored["qweight"], stored["scale"], stored.get("zero"), torch.float32)
    err = (back - w).abs()
    if fmt == "int8":
        assert stored["qweight"].dtype == torch.int8 and stored["scale"].shape == (48,)
        assert (err <= stored["scale"][:, None] / 2 + 1e-7).all()
    elif fmt == "fp8":
        # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the magnitude (normal range)
        assert stored["qweight"].dtype == torch.float8_e4m3fn
        normal = w.abs() > stored["scale"][:, None] * 2 ** -6
        assert (err[normal] <= w.abs()[normal] / 16 + 1e-7).all()
        assert (w.abs().amax(1) / stored["scale"] - 448).abs().max() < 1e-3  # each row's largest maps to 448
    else:
        scale = stored["scale"].float().repeat_interleave(128, dim=1)
        assert stored["qweight"].shape == (48, 128) and stored["scale"].dtype == torch.bfloat16
        assert (err <= scale / 2 * 1.02 + 1e-6).all()  # half a step, plus the bf16 rounding of the zero
    # a wrong dequantization (scales ignored) would be far off: the check is not vacuous
    assert not torch.allclose(stored["qweight"].float() if fmt != "int4" else back * 2, w, atol=1e-3)


def test_int4_reference_matches_a_direct_computation() -> None:
    w = _weight(8, 64)
    stored = quantize.quantize_int4(w, 32)
    q = quantize.unpack_int4(stored["qweight"], 32).float().view(8, 2, 32)
    direct = ((q - stored["zero"].float()[..., None]) * stored["scale"].float()[..., None]).view(8, 64)
    assert torch.equal(quantize.dequantize("int4", stored["qweight"], stored["scale"], stored["zero"], torch.float32),
                       direct)
    assert q.min() == 0 and q.max() == 15  # min/max per group: the extremes use the whole range


def test_gptq_keeps_a_layers_output_closer_than_round_to_nearest() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g)
    # correlated inputs with a few large channels, as a real layer's are
    x = torch.randn(1024, 128, generator=g) @ (torch.eye(128) + 0.3 * torch.randn(128, 128, generator=g))
    x[:, :4] *= 8
    stored = gptq.gptq_int4(w, x.T @ x)
    rtn = quantize.quantize_int4(w)
    out = {name: quantize.dequantize("int4", s["qweight"], s["scale"], s["zero"], torch.float32)
           for name, s in (("gptq", stored), ("rtn", rtn))}
    err = {name: float((x @ (d - w).T).pow(2).mean()) for name, d in out.items()}
    assert err["gptq"] < 0.7 * err["rtn"], err
    assert stored["qweight"].shape == rtn["qweight"].shape and stored["zero"].dtype == torch.bfloat16


def test_a_quantized_linear_holds_the_small_tensors_and_computes_with_their_dequantization() -> None:
    from trtbuild.models.llama import Linear

    w = _weight(48, 64)
    for fmt in ("fp8", "int8", "int4"):
        lin = Linear(64, 48, bias=True)
        bias = lin.bias.detach().clone()
        stored = quantize.quantize(fmt, w)
        lin.hold_quantized(fmt)
        assert "weight" not in dict(lin.named_parameters())
        lin.load_state_dict(stored | {"bias": bias}, assign=True)
        assert set(lin.state_dict()) == {"bias", *stored}
        x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
        ref = F.linear(x, quantize.dequantize(fmt, stored["qweight"], stored["scale"], stored.get("zero"),
                                              torch.bfloat16), bias.to(torch.bfloat16))
        with torch.no_grad():
            assert torch.equal(lin(x.float()), F.linear(x.float(), lin.dense_weight(torch.float32), bias))
            lin.bias.data = lin.bias.data.to(torch.bfloat16)
            assert torch.allclose(lin(x).float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_rtn_state_quantizes_the_layers_linears_only() -> None:
    state = {"tok_embeddings.weight": torch.randn(128, 32), "output.weight": torch.randn(128, 32),
             "layers.0.attention.wqkv.weight": torch.randn(64, 32), "layers.0.attention.wo.weight": torch.randn(32, 32),
             "layers.0.feed_forward.w13.weight": torch.randn(128, 32),
             "layers.0.feed_forward.w2.weight": torch.randn(32, 64), "layers.0.attention_norm.weight": torch.ones(32)}
    out = calibrate.rtn_state(state, "int4")
    assert "output.weight" in out and "tok_embeddings.weight" in out and "layers.0.attention_norm.weight" in out
    for name in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2"):
        assert f"layers.0.{name}.weight" not in out
        kept = name == "feed_forward.w2"  # every down projection is kept int8 (calibrate.INT4_KEPT_INT8)
        assert quantize.format_of(out[f"layers.0.{name}.qweight"]) == ("int8" if kept else "int4")
        assert {f"layers.0.{name}.{b}" for b in ("qweight", "scale", *(() if kept else ("zero",)))} <= set(out)


def _recipe(tmp_path: Path, name: str = "recipe.yaml", **overrides: Any) -> Any:
    return load_recipe(write_recipe(tmp_path, tiny_recipe_doc(**overrides), name))


def test_quantized_precisions_validate_for_the_torch_backend(tmp_path: Path) -> None:
    for precision in ("fp8", "int8_wo", "int4_wo"):
        assert _recipe(tmp_path, precision=precision).precision == precision
    assert _recipe(tmp_path, precision="int4_wo", options={"int4_method": "rtn"}).options["int4_method"] == "rtn"


@pytest.mark.parametrize("overrides, message", [
    ({"precision": "fp8", "options": {"int4_method": "rtn"}}, "options.int4_method: only for precision int4_wo"),
    ({"precision": "int4_wo", "options": {"int4_method": "awq"}}, "options.int4_method: expected one of gptq, rtn"),
    ({"precision": "int3_wo"}, "precision: expected one of"),
    ({"precision": "int4_wo", "options": {"fp8_method": "rtn"}}, "options.fp8_method: only for precision fp8"),
    ({"precision": "fp8", "options": {"fp8_method": "awq"}}, "options.fp8_method: expected one of gptq, rtn"),
    ({"precision": "bf16", "options": {"lm_head": "int8"}}, "options.lm_head: int8 is for a quantized precision"),
    ({"precision": "int4_wo", "options": {"lm_head": "int4"}}, "options.lm_head: expected one of dense, int8"),
])
def test_quantization_options_that_cannot_build_are_named(tmp_path: Path, overrides: dict[str, Any],
                                                          message: str) -> None:
    with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
        _recipe(tmp_path, **overrides)


def test_keys_differ_by_precision_and_by_int4_and_fp8_method(tmp_path: Path, engine_store: Path) -> None:
    from trtbuild import backends
    from trtbuild.builder import key_material
    from trtbuild.models.source import resolve
    from trtbuild.store.local import key_of

    def key(**overrides: Any) -> tuple[str, dict[str, Any]]:
        r = _recipe(tmp_path, **overrides)
        material = key_material(r, resolve(r.model, engine_store), backends.get("torch"), {"torch": "x"})
        return key_of(material), material

    keys = {p: key(precision=p)[0] for p in ("fp32", "bf16", "fp8", "int8_wo", "int4_wo")}
    assert len(set(keys.values())) == 5
    rtn, material = key(precision="int4_wo", options={"int4_method": "rtn"})
    assert rtn != keys["int4_wo"] and material["recipe"]["options"] == {"int4_method": "rtn"}
    assert key(precision="fp8", options={"fp8_method": "rtn"})[0] != keys["fp8"]
    assert key(precision="int4_wo", options={"lm_head": "int8"})[0] != keys["int4_wo"]
    # the quantization code (formats, GPTQ, the calibration text) is part of the engine-code digest
    from trtbuild.builder import engine_code_files

    names = {f.name for f in engine_code_files(backends.get("torch"))}
    assert {"quantize.py", "calibrate.py", "gptq.py", "gptq_block.py", "calibration_text.py", "quantized.py"} <= names


def _tiny_state(folder: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config

    _, cfg = read_config(folder)
    return cfg, convert_hf_state_dict(load_weights(folder, cfg, torch.float32), cfg)


def _same_logits(model: Any, reference: Any) -> None:
    """Both models give exactly the same logits at every position of one prompt."""
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])
    with torch.no_grad():
        got = model(tokens, torch.arange(8), all_logits=True, from_start=True)
        want = reference(tokens, torch.arange(8), all_logits=True, from_start=True)
    assert torch.equal(got, want)


def test_the_build_step_stores_small_tensors_that_the_placed_model_computes_with(tmp_path: Path) -> None:
    """quantize_weights (GPTQ for int4) -> place_model: the Linears hold the stored tensors, and the model's
    logits are those of the dense model with the dequantized weights."""
    from trtbuild.backends.torch.export import place_model
    from trtbuild.backends.torch.quantized import quantize_weights

    folder = make_hf_folder(tmp_path / "m")
    cfg, dense = _tiny_state(folder)
    recipe = SimpleNamespace(precision="int4_wo", options={})
    before = {k: v.clone() for k, v in dense.items()}
    state, record = quantize_weights(dict(dense), cfg, recipe, None, "cpu", lambda m: None)
    assert all(torch.equal(dense[k], v) for k, v in before.items())  # GPTQ worked on copies
    assert record["method"] == "gptq" and record["format"] == "int4" and record["calibration"]["tokenizer"] == "bytes"
    assert state["layers.0.attention.wqkv.qweight"].dtype == torch.uint8
    assert state["tok_embeddings.weight"].dtype == torch.bfloat16 and "output.weight" in state
    shapes = SimpleNamespace(max_batch_size=1, max_input_len=8, max_seq_len=16)
    model = place_model(cfg, shapes, torch.bfloat16, "cpu", state)
    assert model.layers[0].attention.wqkv.quant == "int4"
    dq = dict(state)
    for name in calibrate.quantized_names(dense):  # int4, but the down projections kept int8
        fmt = quantize.format_of(dq[name + ".qweight"])
        dq[name + ".weight"] = quantize.dequantize(fmt, dq.pop(name + ".qweight"), dq.pop(name + ".scale"),
                                                   dq.pop(name + ".zero", None), torch.bfloat16)
    _same_logits(model, place_model(cfg, shapes, torch.bfloat16, "cpu", dq))


@pytest.mark.parametrize("tied", [True, False])
def test_an_int8_lm_head_is_stored_beside_an_exact_embedding_and_computes_as_dequantized(tmp_path: Path,
                                                                                        tied: bool) -> None:
    """options.lm_head int8: the head is stored int8 with a scale a row (after calibration, which ran the dense
    head); a tied model's embedding keeps the dense table, so its lookups are exact, and the head no longer is the
    embedding. The placed model's logits are the dense model's with the head dequantized, and a compile worker's
    empty state has the same tensors, shapes and dtypes."""
    from trtbuild.backends.torch.export import place_model
    from trtbuild.backends.torch.quantized import quantize_weights

    folder = make_hf_folder(tmp_path / "m", TINY_CONFIG | {"tie_word_embeddings": tied})
    cfg, dense = _tiny_state(folder)
    recipe = SimpleNamespace(precision="int8_wo", options={"lm_head": "int8"})
    state, record = quantize_weights(dict(dense), cfg, recipe, None, "cpu", lambda m: None)
    assert record["lm_head"] == "int8" and "LM head" not in record["not_quantized"]
    assert "output.weight" not in state and state["output.qweight"].dtype == torch.int8
    assert state["output.scale"].shape == (cfg.vocab_size,)
    assert state["tok_embeddings.weight"].dtype == torch.bfloat16  # the table, dense
    if tied:
        assert torch.equal(state["tok_embeddings.weight"], dense["tok_embeddings.weight"].to(torch.bfloat16))
    shapes = SimpleNamespace(max_batch_size=1, max_input_len=8, max_seq_len=16)
    model = place_model(cfg, shapes, torch.bfloat16, "cpu", state)
    assert model.output.quant == "int8" and model.tok_embeddings.weight.dtype == torch.bfloat16
    dq = dict(state)
    dq["output.weight"] = quantize.dequantize("int8", dq.pop("output.qweight"), dq.pop("output.scale"), None,
                                              torch.bfloat16)
    _same_logits(model, place_model(cfg, shapes, torch.bfloat16, "cpu", dq))
    empty = calibrate.empty_quantized(dict(dense), "int8", "int8")
    assert {k: (v.shape, v.dtype) for k, v in empty.items() if k.startswith("output.")} == {
        k: (v.shape, v.dtype) for k, v in state.items() if k.startswith("output.")}


@pytest.mark.slow
def test_an_engine_with_an_int8_head_builds_and_runs_untied(tmp_path: Path) -> None:
    """The whole path on a tied model of four layers (so compiled by regions: the head's int8 buffers are
    constants of the last region's program): the engine stores the head's int8 table beside the embedding, says
    it is not tied (the runtime must not point the head at the embedding), and runs."""
    from safetensors import safe_open

    doc = tiny_recipe_doc(name="tiny-head", precision="int8_wo", options={"lm_head": "int8"})
    doc["model"]["config"] |= {"tie_word_embeddings": True, "num_hidden_layers": 4}
    recipe = write_recipe(tmp_path, doc, "head.yaml")
    proc = run_cli("run", str(recipe), "--engines", str(tmp_path / "engines"), "--json")
    assert proc.returncode == 0, proc.stderr
    result = read_json_line(proc.stdout)
    entry = Path(result["engine"]["path"])
    spec = json.loads((entry / "engine.json").read_text())
    assert spec["tied_output"] is False and spec["quantization"]["lm_head"] == "int8"
    with safe_open(str(entry / "weights.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"output.qweight", "output.scale", "tok_embeddings.weight"} <= names and "output.weight" not in names
    assert len(result["output_ids"][0]) == 8
    assert len(spec["graphs"]["prefill"]["regions"]) == 2  # layers 0-2, then layer 3 with the int8 head


def test_fp8_is_calibrated_by_gptq_per_channel_unless_the_recipe_asks_for_rtn(tmp_path: Path) -> None:
    """fp8's default is GPTQ per output channel (it held fp8's budget where rounding missed it); fp8_method rtn
    rounds to nearest, and the two store different weights in the same format."""
    from trtbuild.backends.torch.quantized import quantize_weights

    cfg, dense = _tiny_state(make_hf_folder(tmp_path / "m"))
    got = {m: quantize_weights(dict(dense), cfg, SimpleNamespace(precision="fp8", options=o), None, "cpu",
                               lambda msg: None)
           for m, o in (("gptq", {}), ("rtn", {"fp8_method": "rtn"}))}
    assert {m: r["method"] for m, (_, r) in got.items()} == {"gptq": "gptq", "rtn": "rtn"}
    assert "calibration" in got["gptq"][1] and "calibration" not in got["rtn"][1]
    name = "layers.0.attention.wqkv.qweight"
    a, b = got["gptq"][0][name], got["rtn"][0][name]
    assert a.dtype == b.dtype == torch.float8_e4m3fn and not torch.equal(a.float(), b.float())


@pytest.mark.slow
def test_eval_command_reports_perplexity_and_agreement_on_tiny_engines(tmp_path: Path) -> None:
    """`trtbuild eval` in a real process: an int8_wo engine against the fp32 engine of the same weights."""
    shapes = {"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 32, "batch_buckets": [2]}
    fp32 = write_recipe(tmp_path, tiny_recipe_doc(name="tiny-fp32", shapes=shapes), "fp32.yaml")
    int8 = write_recipe(tmp_path, tiny_recipe_doc(name="tiny-int8", precision="int8_wo", shapes=shapes), "int8.yaml")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    store = tmp_path / "engines"
    proc = run_cli("eval", str(int8), "--text", str(text), "--against", str(fp32), "--engines", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    result = read_json_line(proc.stdout)
    assert result["precision"] == "int8_wo" and result["tokens_from"] == "bytes"
    n = len(text.read_bytes())  # every token after the first, in windows of 32 a half-window apart
    assert result["tokens"] == n and result["tokens_scored"] == n - 1 and result["windows"] == -(-(n - 32) // 16) + 1
    assert 1 < result["perplexity"] < 10 * TINY_CONFIG["vocab_size"] and result["scored_by"].startswith("the engine's")
    a = result["against"]
    assert a["precision"] == "fp32" and a["prompts"] == 8 and a["prompt_len"] == 16 and a["new_tokens"] == 16
    assert 0.5 <= a["greedy_agreement"] <= 1 and 0.5 <= a["teacher_forced_agreement"] <= 1
    assert 0 < a["max_logit_diff"] < 1.0  # int8 per channel on random weights: close, never identical
    entry = json.loads((Path(result["engine"]) / "engine.json").read_text())
    assert entry["quantization"]["format"] == "int8" and entry["quantization"]["method"] == "rtn"
    # a text file that does not exist: one line naming it, no traceback
    bad = run_cli("eval", str(int8), "--text", str(tmp_path / "missing.txt"), "--engines", str(store))
    assert bad.returncode != 0 and "missing.txt" in bad.stderr and "Traceback" not in bad.stderr


def _compressed_fp8_folder(folder: Path, strategy: str) -> Path:
    """The tiny model as llm-compressor writes an FP8 checkpoint: fp8 projections with their weight_scale."""
    from safetensors.torch import load_file, save_file

    make_hf_folder(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = amax / 448.0
        tensors[name] = (w / (scale if strategy == "channel" else scale[0])).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale")] = scale
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                         "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}}},
                                     "ignore": ["lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_a_compressed_tensors_fp8_checkpoint_is_taken_as_stored_for_fp8_and_dequantized_otherwise(
        tmp_path: Path, strategy: str) -> None:
    from safetensors.torch import load_file

    from trtbuild.backends.torch.quantized import quantize_weights
    from trtbuild.models import compressed
    from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config

    folder = _compressed_fp8_folder(tmp_path / "fp8", strategy)
    raw, cfg = read_config(folder)
    stored = load_file(str(folder / "model.safetensors"))
    state = convert_hf_state_dict(load_weights(folder, cfg, torch.float32), cfg)
    kept = compressed.apply(folder, raw, cfg.num_layers, state, keep_fp8=True)
    q = [stored[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert kept["layers.1.attention.wqkv.qweight"].dtype == torch.float8_e4m3fn
    assert torch.equal(kept["layers.1.attention.wqkv.qweight"].view(torch.uint8), torch.cat(q).view(torch.uint8))
    scale = stored["model.layers.1.self_attn.k_proj.weight_scale"].reshape(-1)
    n_q = q[0].shape[0]
    assert torch.equal(kept["layers.1.attention.wqkv.scale"][n_q:n_q + q[1].shape[0]], scale.expand(q[1].shape[0]))
    # the build step quantizes nothing twice: the fp8 bytes reach the engine's weights unchanged
    out, record = quantize_weights(kept, cfg, SimpleNamespace(precision="fp8", options={}), None, "cpu", print)
    assert record["from_checkpoint"]["linears"] == 4 * cfg.num_layers
    assert torch.equal(out["layers.1.attention.wqkv.qweight"].view(torch.uint8), torch.cat(q).view(torch.uint8))
    # any other precision: weight * scale, never the bare fp8 values a cast gives
    dense = compressed.apply(folder, raw, cfg.num_layers, state, keep_fp8=False)
    want = stored["model.layers.0.mlp.down_proj.weight"].float() * stored["model.layers.0.mlp.down_proj.weight_scale"]
    assert torch.equal(dense["layers.0.feed_forward.w2.weight"], want)
    assert not torch.allclose(state["layers.0.feed_forward.w2.weight"], want)


def test_a_compressed_tensors_scheme_trtbuild_does_not_read_is_refused_by_name(tmp_path: Path) -> None:
    from trtbuild.errors import InputError
    from trtbuild.models.compressed import fp8_scheme

    raw = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}}
    with pytest.raises(InputError, match="config.json: quantization_config: compressed-tensors"):
        fp8_scheme(raw, tmp_path / "config.json")
    assert fp8_scheme({"model_type": "llama"}, tmp_path / "config.json") is None


def test_data_free_calibration_samples_the_models_own_text_repeatably(tmp_path: Path) -> None:
    """calibrate.generated_tokens: each sequence starts at its start token, a seed gives the same text again,
    another seed other text, and every token is one the model gives a real probability after its context."""
    from trtbuild.backends.torch.export import place_model

    cfg, state = _tiny_state(make_hf_folder(tmp_path / "m"))
    model = place_model(cfg, SimpleNamespace(max_batch_size=3, max_input_len=24, max_seq_len=24), torch.float32,
                        "cpu", state)
    starts = torch.tensor([3, 50, 100])
    a = calibrate.generated_tokens(model, starts, 24, seed=0)
    assert a.shape == (3, 24) and torch.equal(a[:, 0], starts)
    assert torch.equal(calibrate.generated_tokens(model, starts, 24, seed=0), a)
    assert not torch.equal(calibrate.generated_tokens(model, starts, 24, seed=1), a)
    with torch.no_grad():
        logits = model(a, torch.arange(24), all_logits=True, from_start=True)
    chosen = torch.softmax(logits[:, :-1].float(), -1).gather(-1, a[:, 1:, None])
    assert float(chosen.min()) > 1e-6  # sampled from the model's distribution, never an impossible token


def test_the_sequences_a_model_writes_for_calibration_are_kept_for_its_next_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second quantized build of one checkpoint (int4 after fp8) reads the model's own sequences instead of
    sampling them again, and stores what a build without the cache stores; an unreadable file is written again."""
    from trtbuild.backends.torch.quantized import quantize_weights

    cfg, dense = _tiny_state(make_hf_folder(tmp_path / "m"))
    sampled: list[int] = []
    real = calibrate.generated_tokens
    monkeypatch.setattr(calibrate, "generated_tokens", lambda *a, **k: sampled.append(1) or real(*a, **k))
    cache, lines = tmp_path / "calibration", []

    def build(precision: str, where: Path | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return quantize_weights(dict(dense), cfg, SimpleNamespace(precision=precision, options={}), None, "cpu",
                                lines.append, where)

    _, fp8 = build("fp8", cache)
    int4, record = build("int4_wo", cache)
    assert len(sampled) == 1 and not fp8["calibration"]["generated_from_cache"]
    assert record["calibration"]["generated_from_cache"] and any("written by an earlier build" in m for m in lines)
    fresh, _ = build("int4_wo", None)
    assert len(sampled) == 2 and fresh.keys() == int4.keys() and all(torch.equal(fresh[k], int4[k]) for k in fresh)
    (kept,) = cache.glob("generated-*.pt")
    kept.write_bytes(b"not a tensor")
    _, again = build("fp8", cache)
    assert len(sampled) == 3 and not again["calibration"]["generated_from_cache"]


def test_int4_linears_kept_at_int8_are_int8_in_every_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """INT4_KEPT_INT8: the first layer's down projection stays int8 in GPTQ's result, round to nearest's, and the
    empty buffers a compile worker exports from, so that the build's graphs and the workers' are the same."""
    from trtbuild.backends.torch.quantized import quantize_weights

    monkeypatch.setattr(calibrate, "INT4_KEPT_INT8", (("first", "feed_forward.w2"),))
    cfg, dense = _tiny_state(make_hf_folder(tmp_path / "m"))
    gptq, record = quantize_weights(dict(dense), cfg, SimpleNamespace(precision="int4_wo", options={}), None, "cpu",
                                    lambda m: None)
    rtn = calibrate.rtn_state(dict(dense), "int4")
    empty = calibrate.empty_quantized(dict(dense), "int4")
    assert record["kept_int8"] == ["layers.0.feed_forward.w2"]
    for stored in (gptq, rtn, empty):
        assert stored["layers.0.feed_forward.w2.qweight"].dtype == torch.int8
        assert "layers.0.feed_forward.w2.zero" not in stored
        assert stored["layers.1.feed_forward.w2.qweight"].dtype == torch.uint8
        assert stored["layers.0.feed_forward.w13.qweight"].dtype == torch.uint8
        assert {k: (v.shape, v.dtype) for k, v in stored.items() if k.endswith(("qweight", "scale", "zero"))} == \
            {k: (v.shape, v.dtype) for k, v in empty.items() if k.endswith(("qweight", "scale", "zero"))}
    assert record["calibration"]["largest_errors"]  # each Linear's sensitivity, the worst first


def test_awq_scales_move_into_the_norm_gain_so_the_product_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AWQ_GRID on: where a scaling was chosen, the stored norm gain is divided by the scales the weight was
    multiplied by, so gain x weight (what the model multiplies) stays the checkpoint's, within int4's error."""
    from trtbuild.backends.torch.quantized import quantize_weights

    monkeypatch.setattr(calibrate, "AWQ_GRID", (0.25, 0.5, 0.75, 1.0))
    cfg, dense = _tiny_state(make_hf_folder(tmp_path / "m"))
    # inputs of very different energies: the case scaling is for (the tiny model's random gains are all ones)
    for i in range(cfg.num_layers):
        dense[f"layers.{i}.attention_norm.weight"] = torch.logspace(-1, 1, cfg.hidden_size)[torch.randperm(cfg.hidden_size)]
    state, _ = quantize_weights(dict(dense), cfg, SimpleNamespace(precision="int4_wo", options={}), None, "cpu",
                                lambda m: None)
    moved = [i for i in range(cfg.num_layers) if not torch.equal(state[f"layers.{i}.attention_norm.weight"].float(),
                                                                  dense[f"layers.{i}.attention_norm.weight"])]
    assert moved  # scaling was chosen somewhere
    for i in moved:
        p = f"layers.{i}.attention.wqkv"
        w = quantize.dequantize("int4", state[p + ".qweight"], state[p + ".scale"], state[p + ".zero"], torch.float32)
        got = w * state[f"layers.{i}.attention_norm.weight"].float()[None, :]
        want = dense[p + ".weight"] * dense[f"layers.{i}.attention_norm.weight"][None, :]
        assert float((got - want).norm() / want.norm()) < 0.2


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_gptq_per_channel_keeps_the_output_closer_than_round_to_nearest(fmt: str) -> None:
    """gptq.gptq_channel: the stored format of round to nearest (same scales), and a smaller output error
    tr(dW H dW^T) under correlated inputs, which is what it is for."""
    g = torch.Generator().manual_seed(0)
    w = _weight(64, 256)
    x = torch.randn(2048, 256, generator=g) @ (torch.eye(256) + 0.5 * torch.randn(256, 256, generator=g) / 16)
    h = x.T @ x / x.shape[0]
    calibrated, rtn = gptq.gptq_channel(w, h, fmt), quantize.quantize(fmt, w)
    assert calibrated["qweight"].dtype == rtn["qweight"].dtype and torch.allclose(calibrated["scale"], rtn["scale"])

    def err(stored: dict[str, torch.Tensor]) -> float:
        dw = quantize.dequantize(fmt, stored["qweight"], stored["scale"], None, torch.float32) - w
        return float(((dw @ h) * dw).sum())
    assert err(calibrated) < 0.8 * err(rtn)
