"""Contract tests of backend `tensorrt` against the strict TensorRT double (10.x, 10.16.1, 11.1 flavours)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock, Timeout

from tests.doubles import tiny_onnx
from tests.doubles.strict import PYBIND_ENUM_BUILTINS, SURFACE_DIR
from trtbuild.backends.tensorrt import common as trt_common
from trtbuild.errors import BackendUnavailableError, InputError, RecipeError, TrtbuildError
from trtbuild.recipe import load_recipe

pytestmark = pytest.mark.contract
SURFACES = {"10.x": "tensorrt_api_surface_10x_common.json", "10.16": "tensorrt_api_surface.json",
            "11.1": "tensorrt_api_surface_11.1.json"}


def _build_and_run(recipe_path: Path, engines: Path, prompt: list[list[int]], n: int) -> tuple[Any, list[list[int]]]:
    from trtbuild.builder import build
    from trtbuild.runner import open_session

    recipe = load_recipe(recipe_path)
    outcome = build(recipe, engines=engines)
    with open_session(recipe, engines=engines) as session:
        tokens = session.greedy(prompt, n)
    return outcome, tokens


@pytest.mark.parametrize("flavour,precision", [("10.x", "fp16"), ("10.16", "fp32"), ("10.16", "onnx"), ("11.1", "onnx")])
def test_recipe_to_build_to_store_to_run(install_trt: Any, onnx_recipe: Any, tmp_path: Path, flavour: str,
                                         precision: str) -> None:
    trt = install_trt(flavour)
    path = onnx_recipe(precision=precision, options={"profiling_verbosity": "detailed", "workspace_mib": 256})
    outcome, tokens = _build_and_run(path, tmp_path / "engines", [[1, 2, 3], [7, 8, 9]], 4)
    assert not outcome.cache_hit
    assert {"engine.plan", "engine.json", "inspector.json", "manifest.json"} <= {p.name for p in outcome.entry.path.iterdir()}
    assert tokens == [[4, 5, 6, 7], [10, 11, 12, 13]]  # the tiny LM's greedy token is id + 1
    inspector = json.loads((outcome.entry.path / "inspector.json").read_text())
    assert all("TacticName" in layer for layer in inspector["Layers"])
    assert outcome.entry.manifest["tactics"]["layers"][0]["tactic"].startswith("sm90_")
    assert outcome.entry.manifest["tactics"]["builder_optimization_level"] == 3
    assert ("BuilderFlag.FP16" in trt._fake_recorder.names) == (flavour == "10.x")
    again, _ = _build_and_run(path, tmp_path / "engines", [[1]], 1)
    assert again.cache_hit and trt._fake_state["builds"] == 1


@pytest.mark.parametrize("flavour", list(SURFACES))
def test_every_name_the_backend_touched_is_in_the_real_api(install_trt: Any, onnx_recipe: Any, tmp_path: Path,
                                                            flavour: str) -> None:
    trt = install_trt(flavour)
    precision = "onnx" if flavour == "11.1" else "fp16"
    _build_and_run(onnx_recipe(precision=precision), tmp_path / "engines", [[1, 2]], 2)
    surface = json.loads((SURFACE_DIR / SURFACES[flavour]).read_text())  # read again, not through the double
    touched = sorted(trt._fake_recorder.names)
    assert touched, "nothing was recorded"
    outside = []
    for name in touched:
        owner, _, member = name.rpartition(".")
        if owner == "tensorrt":
            ok = member in surface["tensorrt"]
        else:
            ok = member in surface.get(owner, []) or member in PYBIND_ENUM_BUILTINS
        if not ok:
            outside.append(name)
    assert outside == []


def test_backend_runs_on_every_10x(install_trt: Any, onnx_recipe: Any, tmp_path: Path) -> None:
    """With only the names present in all of 10.0.0-10.16.1, a default recipe builds and runs."""
    install_trt("10.x")
    _, tokens = _build_and_run(onnx_recipe(), tmp_path / "engines", [[0]], 3)
    assert tokens == [[1, 2, 3]]


def test_double_rejects_names_the_real_api_lacks(install_trt: Any) -> None:
    trt = install_trt("10.16")
    with pytest.raises(AttributeError):
        _ = trt.BuilderFlag.STRICT_TYPES  # removed before 10.0
    builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    with pytest.raises(AttributeError):
        _ = builder.build_engine  # not in 10.x
    config = builder.create_builder_config()
    with pytest.raises(TypeError):
        config.set_timing_cache(config.create_timing_cache(b""), ignore=True)  # the keyword is ignore_mismatch
    with pytest.raises(TypeError):
        trt.IBuilderConfig()  # no constructor in the bindings
    with pytest.raises(AttributeError):
        _ = trt.nonexistent_function
    eleven = install_trt("11.1")
    with pytest.raises(AttributeError):
        _ = eleven.BuilderFlag.FP16  # precision flags were removed in 11.0
    with pytest.raises(AttributeError):
        install_trt("10.x").Builder(trt.Logger()).create_builder_config().max_num_tactics = 4  # 10.4+


def test_tensorrt_11_refuses_precision_flags_with_the_fix(install_trt: Any, onnx_recipe: Any, tmp_path: Path) -> None:
    install_trt("11.1")
    with pytest.raises(InputError, match="precision: onnx"):
        _build_and_run(onnx_recipe(precision="fp16"), tmp_path / "engines", [[1]], 1)


def test_max_num_tactics_needs_10_4(install_trt: Any, onnx_recipe: Any, tmp_path: Path) -> None:
    install_trt("10.x")
    with pytest.raises(InputError, match="max_num_tactics: needs TensorRT 10.4"):
        _build_and_run(onnx_recipe(options={"max_num_tactics": 8}), tmp_path / "e1", [[1]], 1)
    install_trt("10.16")
    outcome, _ = _build_and_run(onnx_recipe(options={"max_num_tactics": 8}), tmp_path / "e2", [[1]], 1)
    assert outcome.entry.manifest["tactics"]["max_num_tactics"] == 8


@pytest.mark.parametrize("options,expected", [
    ({"workspace": 1}, "options.workspace: unknown option for backend tensorrt; did you mean 'workspace_mib'?"),
    ({"workspace_mib": 0}, "options.workspace_mib: expected a positive integer, got 0"),
    ({"max_num_tactics": "many"}, "options.max_num_tactics: expected a positive integer"),
    ({"profiling_verbosity": "loud"}, "options.profiling_verbosity: expected one of layer_names_only, detailed, none"),
])
def test_bad_options_are_reported_by_path(onnx_recipe: Any, options: dict[str, Any], expected: str) -> None:
    with pytest.raises(RecipeError) as err:
        load_recipe(onnx_recipe(options=options))
    assert any(expected in p for p in err.value.problems), err.value.problems


def test_a_hugging_face_source_is_not_for_backend_tensorrt(tmp_path: Path) -> None:
    from tests.conftest import tiny_recipe_doc, write_recipe

    doc = tiny_recipe_doc(backend="tensorrt", precision="fp16")
    with pytest.raises(RecipeError, match="model.source: backend tensorrt builds from an .onnx file"):
        load_recipe(write_recipe(tmp_path, doc))


@pytest.mark.parametrize("model,expected", [
    (tiny_onnx.unsupported(), "node 1 (my_custom_node, op FancyCustomOp): UNSUPPORTED_NODE: No importer"),
    (b"not an onnx file", "model: MODEL_DESERIALIZE_FAILED"),
])
def test_parser_errors_name_node_and_reason(install_trt: Any, onnx_recipe: Any, tmp_path: Path, model: bytes,
                                            expected: str) -> None:
    install_trt("10.16")
    with pytest.raises(InputError) as err:
        _build_and_run(onnx_recipe(model=model, shapes={"max_batch_size": 1, "max_input_len": 4, "max_seq_len": 8}),
                       tmp_path / "engines", [[1]], 1)
    assert expected in str(err.value)


def _plan(trt: Any, onnx_path: Path) -> bytes:
    logger = trt_common.capturing_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    assert trt.OnnxParser(network, logger).parse_from_file(str(onnx_path))
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 8), (2, 8), (2, 8))
    config.add_optimization_profile(profile)
    return bytes(memoryview(builder.build_serialized_network(network, config)))


@pytest.mark.parametrize("runtime_flavour,cc,plan_bytes,reason", [
    ("11.1", "9.0", None, "version_mismatch"),
    ("10.16", "8.9", None, "device_mismatch"),
    ("10.16", "9.0", b"\x00garbage", "not_a_plan"),
])
def test_deserialization_failures_are_classified(install_trt: Any, tmp_path: Path, runtime_flavour: str, cc: str,
                                                 plan_bytes: bytes | None, reason: str) -> None:
    (tmp_path / "m.onnx").write_bytes(tiny_onnx.mlp())
    plan = plan_bytes or _plan(install_trt("10.16", "9.0"), tmp_path / "m.onnx")
    trt = install_trt(runtime_flavour, cc)
    logger = trt_common.capturing_logger(trt)
    assert trt.Runtime(logger).deserialize_cuda_engine(plan) is None
    err = trt_common.classify_deserialize_failure(logger.errors())
    assert err.reason == reason and isinstance(err, TrtbuildError) and "rebuild" in str(err)


def test_loading_under_another_tensorrt_is_refused_before_deserializing(install_trt: Any, onnx_recipe: Any,
                                                                        tmp_path: Path) -> None:
    from trtbuild import backends
    from trtbuild.builder import build

    install_trt("10.16")
    outcome = build(load_recipe(onnx_recipe()), engines=tmp_path / "engines")
    other = install_trt("11.1")
    engine = backends.get("tensorrt").load(outcome.entry.path, outcome.entry.manifest)
    with pytest.raises(trt_common.IncompatibleEngineError, match="built by TensorRT 10.16.1.11") as err:
        engine.__enter__()
    assert err.value.reason == "version_mismatch" and "Runtime.deserialize_cuda_engine" not in other._fake_recorder.names


def test_timing_cache_is_merged_under_the_lock_never_overwritten(install_trt: Any, onnx_recipe: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from trtbuild.builder import build

    trt = install_trt("10.16")
    real_write = trt_common.write_atomic
    held: list[bool] = []

    def write_checking_lock(path: Path, data: bytes) -> None:
        try:
            FileLock(str(path.parent / ".lock")).acquire(timeout=0)
            held.append(False)
        except Timeout:
            held.append(True)
        real_write(path, data)

    monkeypatch.setattr(trt_common, "write_atomic", write_checking_lock)
    first = build(load_recipe(onnx_recipe(model=tiny_onnx.lm())), engines=tmp_path / "engines")
    cache_file = Path(first.entry.manifest["tactics"]["timing_cache"]["path"])
    after_first = json.loads(cache_file.read_bytes().split(b"\n", 1)[1])["entries"]
    second = build(load_recipe(onnx_recipe(model=tiny_onnx.mlp(), name="mlp")), engines=tmp_path / "engines")
    merged = json.loads(cache_file.read_bytes().split(b"\n", 1)[1])["entries"]
    assert held and all(held)
    assert set(after_first) < set(merged)  # the second model's entries joined the first's
    assert second.entry.manifest["tactics"]["timing_cache"]["used_store_cache"]
    # a rebuild of the first model finds every layer in the cache
    hits = trt._fake_state["cache_hits"]
    import shutil

    shutil.rmtree(first.entry.path)
    build(load_recipe(onnx_recipe(model=tiny_onnx.lm())), engines=tmp_path / "engines")
    assert trt._fake_state["cache_hits"] == hits + 2


def test_a_foreign_timing_cache_is_set_aside_not_dropped(install_trt: Any, onnx_recipe: Any, tmp_path: Path) -> None:
    from trtbuild.builder import build
    from trtbuild.store.tactics import TacticCache

    install_trt("10.16")
    recipe = load_recipe(onnx_recipe())
    first = build(recipe, engines=tmp_path / "engines")
    cache_file = Path(first.entry.manifest["tactics"]["timing_cache"]["path"])
    cache_file.write_bytes(b"written by something else")
    trt = sys.modules["tensorrt"]
    logger = trt_common.capturing_logger(trt)
    config = trt.Builder(logger).create_builder_config()
    summary = trt_common.merge_back(config, logger, TacticCache(cache_file.parent, {}), config.create_timing_cache(b""))
    assert Path(summary["set_aside"]).read_bytes() == b"written by something else"
    assert cache_file.read_bytes().startswith(b"FAKETRT-TIMINGCACHE1")


def test_a_plain_tensor_network_runs_first_and_steady_state(install_trt: Any, onnx_recipe: Any, tmp_path: Path) -> None:
    from trtbuild.builder import build
    from trtbuild.runner import open_session

    trt = install_trt("10.16")
    recipe = load_recipe(onnx_recipe(model=tiny_onnx.mlp(), precision="fp32"))
    build(recipe, engines=tmp_path / "engines")
    with open_session(recipe, engines=tmp_path / "engines") as session:
        session.greedy([[0], [0], [0]], 5)  # batch 3 picks the bucket-4 profile
        gen = session.last
    assert gen.output_ids == [[], [], []] and len(gen.decode_step_s) == 4 and gen.prefill_s > 0
    assert trt._fake_state["executions"] >= 5


def test_unavailable_backend_names_what_to_install(monkeypatch: pytest.MonkeyPatch, onnx_recipe: Any) -> None:
    from trtbuild import backends
    from trtbuild.builder import build

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError, as when not installed
    available, reason = backends.availability("tensorrt")
    assert not available and "tensorrt" in reason
    with pytest.raises(BackendUnavailableError) as err:
        build(load_recipe(onnx_recipe()))
    assert "NVIDIA's Python package index" in str(err.value)


@pytest.mark.needs_tensorrt
def test_real_tensorrt_builds_the_example_recipe(tmp_path: Path) -> None:
    from trtbuild.builder import build

    outcome = build(load_recipe(Path(__file__).parents[2] / "recipes" / "onnx-tiny-lm.yaml"), engines=tmp_path)
    assert (outcome.entry.path / "engine.plan").stat().st_size > 0


@pytest.mark.parametrize("flavour", ["10.x", "11.1"])
def test_the_example_recipe_builds_and_runs_on_the_double(install_trt: Any, tmp_path: Path, flavour: str) -> None:
    install_trt(flavour)
    path = Path(__file__).parents[2] / "recipes" / "onnx-tiny-lm.yaml"
    _, tokens = _build_and_run(path, tmp_path / "engines", [[5, 6]], 3)
    assert tokens == [[7, 8, 9]]
