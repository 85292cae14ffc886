"""Contract tests of backend `tensorrt-llm` against the strict TensorRT-LLM double (0.13, 1.0, 1.2, 1.3)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import tiny_recipe_doc, write_recipe
from trtbuild.backends.tensorrt import common as trt_common
from trtbuild.backends.tensorrt.llm import quant_plan
from trtbuild.errors import BackendUnavailableError, RecipeError, TrtbuildError
from trtbuild.recipe import load_recipe

pytestmark = pytest.mark.contract


def _recipe(tmp_path: Path, **overrides: Any) -> Any:
    doc = tiny_recipe_doc(backend="tensorrt-llm", precision="fp16", tactics={"level": "default"})
    doc.update(overrides)
    return load_recipe(write_recipe(tmp_path / "recipes", doc))


def _build(recipe: Any, engines: Path) -> Any:
    from trtbuild.builder import build

    return build(recipe, engines=engines)


@pytest.mark.parametrize("flavour", ["0.13", "1.0", "1.2"])
def test_recipe_to_build_to_store_to_run(install_trtllm: Any, tmp_path: Path, flavour: str) -> None:
    from trtbuild.runner import open_session

    lib = install_trtllm(flavour)
    recipe = _recipe(tmp_path, parallel={"tp": 2})
    outcome = _build(recipe, tmp_path / "engines")
    files = {p.name for p in outcome.entry.path.iterdir()}
    assert {"config.json", "rank0.engine", "rank1.engine", "manifest.json"} <= files and ".llm-workspace" not in files
    info = outcome.entry.manifest["backend_info"]
    assert info["versions"]["tensorrt_llm"] == lib.__version__ and info["versions"]["tensorrt"] == "10.16.1.11"
    assert "step_building_trt_llm_engine_s" in outcome.entry.manifest["build"]["phases"]
    with open_session(recipe, engines=tmp_path / "engines") as session:
        tokens = session.greedy([[1, 2, 3], [7, 8, 9]], 4)
        gen = session.last
    assert tokens == [[4, 5, 6, 7], [10, 11, 12, 13]]  # the double's greedy token is last + 1
    assert gen.prefill_s > 0 and len(gen.decode_step_s) == 3
    assert _build(recipe, tmp_path / "engines").cache_hit and lib._fake_state["builds"] == 1


@pytest.mark.parametrize("precision,options,expected", [
    ("fp16", {}, {"dtype": "float16", "quant_algo": None, "kv_cache_quant_algo": None}),
    ("bf16", {"kv_cache_dtype": "fp8"}, {"dtype": "bfloat16", "quant_algo": None, "kv_cache_quant_algo": "FP8"}),
    ("fp8", {"kv_cache_dtype": "fp8"}, {"dtype": "auto", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}),
    ("int8_wo", {"dtype": "bfloat16"}, {"dtype": "bfloat16", "quant_algo": "W8A16", "kv_cache_quant_algo": None}),
    ("int4_wo", {}, {"dtype": "auto", "quant_algo": "W4A16", "kv_cache_quant_algo": None}),
    ("int4_awq", {}, {"dtype": "auto", "quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None}),
])
def test_precision_maps_to_dtype_and_quant_config(install_trtllm: Any, tmp_path: Path, precision: str,
                                                  options: dict[str, Any], expected: dict[str, Any]) -> None:
    assert quant_plan(precision, options) == expected
    install_trtllm("1.2")
    outcome = _build(_recipe(tmp_path, precision=precision, options=options), tmp_path / "engines")
    quant = json.loads((outcome.entry.path / "config.json").read_text())["pretrained_config"]["quantization"]
    assert quant == {"quant_algo": expected["quant_algo"], "kv_cache_quant_algo": expected["kv_cache_quant_algo"]}


def test_build_config_comes_from_the_recipe(install_trtllm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_trtllm("1.2")
    monkeypatch.chdir(tmp_path)
    options = {"max_num_tokens": 256, "opt_batch_size": 2, "gemm_plugin": "auto", "multiple_profiles": True,
               "use_paged_context_fmha": False}
    outcome = _build(_recipe(tmp_path, options=options), tmp_path / "engines")
    bc = json.loads((outcome.entry.path / "config.json").read_text())["build_config"]
    assert (bc["max_batch_size"], bc["max_input_len"], bc["max_seq_len"]) == (2, 16, 48)
    assert (bc["max_num_tokens"], bc["opt_batch_size"]) == (256, 2)
    assert bc["plugin_config"]["gemm_plugin"] == "auto" and bc["plugin_config"]["multiple_profiles"] is True
    assert bc["plugin_config"]["use_paged_context_fmha"] is False
    for key in ("input_timing_cache", "output_timing_cache"):
        assert Path(bc[key]).is_absolute()
    assert bc["input_timing_cache"] == bc["output_timing_cache"]
    assert not (tmp_path / "model.cache").exists()  # TensorRT-LLM's relative default never used


def test_timing_cache_is_reused_and_merged(install_trtllm: Any, tmp_path: Path) -> None:
    lib = install_trtllm("1.2")
    recipe = _recipe(tmp_path)
    first = _build(recipe, tmp_path / "engines")
    cache = Path(first.entry.manifest["tactics"]["timing_cache"]["path"])
    assert cache.is_file() and lib._fake_state["cache_hits"] == 0
    assert not list(cache.parent.glob(".build-*"))  # the private copy is gone
    shutil.rmtree(first.entry.path)
    _build(recipe, tmp_path / "engines")
    assert lib._fake_state["cache_hits"] == 3  # every layer kind came from the store's cache


@pytest.mark.parametrize("overrides,expected", [
    ({"options": {"tensor_parallel": 2}}, "options.tensor_parallel: unknown option for backend tensorrt-llm"),
    ({"options": {"tp": 2}}, "options.tp: moved to the recipe's parallel.tp"),
    ({"parallel": {"tp": 0}}, "parallel.tp: must be >= 1, got 0"),
    ({"options": {"pp": 0}}, "options.pp: expected a positive integer, got 0"),
    ({"options": {"opt_batch_size": 64}}, "options.opt_batch_size: 64 exceeds shapes.max_batch_size 2"),
    ({"options": {"gemm_plugin": "fp8"}}, "options.gemm_plugin: 'fp8' needs precision: fp8"),
    ({"options": {"gemm_plugin": "fast"}}, "options.gemm_plugin: expected one of auto"),
    ({"options": {"kv_cache_dtype": "int8"}}, "options.kv_cache_dtype: expected auto or fp8"),
    ({"options": {"dtype": "bfloat16"}}, "options.dtype: only for quantized precisions"),
    ({"options": {"multiple_profiles": "yes"}}, "options.multiple_profiles: expected true or false"),
    ({"shapes": {"max_batch_size": 4, "max_input_len": 8, "max_seq_len": 16, "batch_buckets": [1, 4]}},
     "shapes.batch_buckets: tensorrt-llm makes its own optimization profiles"),
    ({"tactics": {"level": "max"}}, "tactics.level: tensorrt-llm's build API has no builder optimization level"),
    ({"precision": "fp32"}, "precision: expected one of fp16, bf16, fp8, int8_wo, int4_wo, int4_awq"),
])
def test_bad_recipes_are_reported_by_path(tmp_path: Path, overrides: dict[str, Any], expected: str) -> None:
    with pytest.raises(RecipeError) as err:
        _recipe(tmp_path, **overrides)
    assert any(expected in p for p in err.value.problems), err.value.problems


def test_tensorrt_llm_1_3_says_the_engine_backend_was_removed(install_trtllm: Any, tmp_path: Path) -> None:
    install_trtllm("1.3")
    with pytest.raises(BackendUnavailableError, match="removed the TensorRT engine backend") as err:
        _build(_recipe(tmp_path), tmp_path / "engines")
    assert "NVIDIA's Python package index" in str(err.value)


def test_not_installed_names_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from trtbuild import backends

    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    available, reason = backends.availability("tensorrt-llm")
    assert not available and "tensorrt_llm" in reason and "NVIDIA's Python package index" in reason
    with pytest.raises(BackendUnavailableError):
        _build(_recipe(tmp_path), tmp_path / "engines")


def test_load_checks_every_rank_before_the_runtime(install_trtllm: Any, tmp_path: Path) -> None:
    from trtbuild import backends

    lib = install_trtllm("1.2")
    outcome = _build(_recipe(tmp_path, parallel={"tp": 2}), tmp_path / "engines")
    (outcome.entry.path / "rank1.engine").unlink()
    with pytest.raises(TrtbuildError, match="rank1.engine missing"):
        backends.get("tensorrt-llm").load(outcome.entry.path, outcome.entry.manifest)
    assert lib._fake_state["loads"] == 0


def test_load_refuses_another_tensorrt_llm_version(install_trtllm: Any, tmp_path: Path) -> None:
    from trtbuild import backends

    install_trtllm("1.0")
    outcome = _build(_recipe(tmp_path), tmp_path / "engines")
    newer = install_trtllm("1.2")
    with pytest.raises(trt_common.IncompatibleEngineError, match="tensorrt_llm 1.0.0; installed is 1.2.0"):
        backends.get("tensorrt-llm").load(outcome.entry.path, outcome.entry.manifest)
    assert newer._fake_state["loads"] == 0


def test_double_rejects_names_the_real_api_lacks(install_trtllm: Any) -> None:
    install_trtllm("1.2")
    from tensorrt_llm._tensorrt_engine import LLM
    from tensorrt_llm.llmapi import BuildConfig, QuantAlgo, SamplingParams

    with pytest.raises(TypeError):
        BuildConfig(max_batch=8)  # the field is max_batch_size
    with pytest.raises(AttributeError):
        BuildConfig().plugin_config.gemm = "auto"
    with pytest.raises(ValueError):
        BuildConfig().plugin_config.gemm_plugin = "fastest"
    with pytest.raises(TypeError):
        SamplingParams(16)  # keyword-only dataclass
    with pytest.raises(AttributeError):
        _ = QuantAlgo.INT4_AWQ  # the member is W4A16_AWQ
    with pytest.raises(ValueError, match="got invalid argument"):
        LLM(model="x", max_batch=4)
    with pytest.raises(ImportError):
        import tensorrt_llm.hlapi  # noqa: F401  (not in 1.x)
    import tensorrt_llm

    with pytest.raises(ValueError, match="specific to TensorRT backend"):
        tensorrt_llm.LLM(model="x", quant_config=None)  # 1.x's top-level LLM is the PyTorch flow


@pytest.mark.needs_tensorrt
def test_real_tensorrt_llm_builds_the_example_recipe(tmp_path: Path) -> None:
    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "llama-3.2-1b-trtllm.yaml")
    outcome = _build(recipe, tmp_path)
    assert (outcome.entry.path / "rank0.engine").stat().st_size > 0
