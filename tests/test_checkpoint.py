"""Model folders that do not load give an `InputError` naming the file and the field or tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY_CONFIG, make_hf_folder
from trtbuild.errors import InputError
from trtbuild.models.checkpoint import hf_parameter_shapes, load_weights, read_config, weight_files, write_synthetic
from trtbuild.models.llama import LlamaConfig


def load(folder: Path) -> dict[str, torch.Tensor]:
    _, cfg = read_config(folder)
    return load_weights(folder, cfg, torch.float32)


def input_error(folder: Path) -> InputError:
    with pytest.raises(InputError) as info:
        load(folder)
    assert info.value.exit_code == 2
    return info.value


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def test_synthetic_folder_loads_every_tensor(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    weights = load(folder)
    _, cfg = read_config(folder)
    assert {n: tuple(t.shape) for n, t in weights.items()} == hf_parameter_shapes(cfg)
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_missing_config_json(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    (folder / "config.json").unlink()
    message = str(input_error(folder))
    assert str(folder / "config.json") in message and "not found" in message


def test_truncated_config_json(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    path = folder / "config.json"
    path.write_text(path.read_text()[:40])
    message = str(input_error(folder))
    assert message.startswith(f"{path}: not valid JSON (truncated?) at line")


def test_config_json_that_is_not_an_object(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    (folder / "config.json").write_text("[1, 2]")
    assert "expected a JSON object" in str(input_error(folder))


def test_unsupported_model_type(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    edit_config(folder, model_type="gpt2")
    message = str(input_error(folder))
    assert message.startswith(f"{folder / 'config.json'}: model_type: 'gpt2' is not supported")


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers"])
def test_missing_required_field(tmp_path: Path, field: str) -> None:
    folder = make_hf_folder(tmp_path / "m")
    edit_config(folder, **{field: None})
    assert str(input_error(folder)) == f"{folder / 'config.json'}: {field}: required field missing"


def test_field_of_the_wrong_type(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    edit_config(folder, hidden_size="wide")
    message = str(input_error(folder))
    assert message.startswith(f"{folder / 'config.json'}: a field has the wrong type")


def test_zero_heads_is_a_bad_value_not_a_crash(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    edit_config(folder, num_attention_heads=0, num_key_value_heads=None)
    assert str(folder / "config.json") in str(input_error(folder))


def test_kv_heads_that_do_not_divide_heads(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    edit_config(folder, num_key_value_heads=3)
    assert "num_key_value_heads: 3 does not divide num_attention_heads 4" in str(input_error(folder))


@pytest.mark.parametrize("scaling, named", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling: rope_scaling type 'yarn' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_scaling.low_freq_factor: required field missing"),
])
def test_rope_scaling_the_model_cannot_compute(tmp_path: Path, scaling: dict[str, Any], named: str) -> None:
    folder = make_hf_folder(tmp_path / "m")
    edit_config(folder, rope_scaling=scaling)
    assert str(input_error(folder)).startswith(f"{folder / 'config.json'}: {named}")


def _rewrite_weights(folder: Path, change: Any) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_safetensors_missing_a_tensor(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    message = str(input_error(folder))
    assert message == f"{folder}: tensor(s) missing from the checkpoint: model.layers.1.mlp.up_proj.weight"


def test_many_missing_tensors_are_summarised(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    _rewrite_weights(folder, lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.")])
    assert "and 13 more" in str(input_error(folder))


def test_mis_shaped_tensor(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    _rewrite_weights(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)}))
    message = str(input_error(folder))
    assert message == (f"{folder / 'model.safetensors'}: tensor model.layers.0.self_attn.k_proj.weight has shape "
                       "(8, 32), config.json implies (16, 32)")


def test_truncated_safetensors(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = str(input_error(folder))
    assert message.startswith(f"{path}: not a readable safetensors file (truncated or corrupt?)")


def test_garbage_safetensors(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    assert str(folder / "model.safetensors") in str(input_error(folder))


def test_folder_without_weights(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    error = input_error(folder)
    assert str(error).startswith(f"{folder}: no *.safetensors weight files") and error.hint


def _shard(folder: Path) -> None:
    """Split model.safetensors into two shards with an index, as save_pretrained does."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path: Path) -> None:
    single = load(make_hf_folder(tmp_path / "a"))
    folder = make_hf_folder(tmp_path / "b")
    _shard(folder)
    assert [f.name for f in weight_files(folder)] == ["model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]
    sharded = load(folder)
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[n], single[n]) for n in single)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    _shard(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    error = input_error(folder)
    assert str(error).startswith(f"{folder / 'model.safetensors.index.json'}: weight_map names shard(s) that are not "
                                 "in the folder: model-00002-of-00002.safetensors")
    assert error.hint


def test_unreadable_index(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    _shard(folder)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    assert str(input_error(folder)).startswith(f"{folder / 'model.safetensors.index.json'}: weight_map:")


def test_weights_are_cast_to_the_requested_dtype(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    _, cfg = read_config(folder)
    assert {t.dtype for t in load_weights(folder, cfg, torch.bfloat16).values()} == {torch.bfloat16}


# -- write_synthetic ----------------------------------------------------------------------------------


def test_write_synthetic_is_deterministic(tmp_path: Path) -> None:
    write_synthetic(tmp_path / "a", dict(TINY_CONFIG), seed=3)
    write_synthetic(tmp_path / "b", dict(TINY_CONFIG), seed=3)
    write_synthetic(tmp_path / "c", dict(TINY_CONFIG), seed=4)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_write_synthetic_writes_a_hugging_face_folder(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    write_synthetic(folder, dict(TINY_CONFIG), seed=0)
    raw, cfg = read_config(folder)
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["torch_dtype"] == "float32"
    assert cfg == LlamaConfig.from_hf(TINY_CONFIG)
    tensors = load_file(str(folder / "model.safetensors"))
    assert torch.equal(tensors["model.norm.weight"], torch.ones(32))
    assert tensors["model.embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.2)


def test_write_synthetic_honours_bfloat16(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    write_synthetic(folder, {**TINY_CONFIG, "torch_dtype": "bfloat16"}, seed=0)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    fp32 = tmp_path / "fp32"
    write_synthetic(fp32, dict(TINY_CONFIG), seed=0)
    # the same draws, rounded: bf16 must not be a different random stream
    reference = load_file(str(fp32 / "model.safetensors"))
    assert all(torch.equal(tensors[n], reference[n].to(torch.bfloat16)) for n in reference)


def test_write_synthetic_rejects_an_unknown_dtype(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="model.config.torch_dtype: expected one of float32, float16, bfloat16"):
        write_synthetic(tmp_path / "m", {**TINY_CONFIG, "torch_dtype": "float8"}, seed=0)
