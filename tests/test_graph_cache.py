"""The compiled-graph cache's key before export: what it depends on, and when a record is trusted."""

from __future__ import annotations

from pathlib import Path

from trtbuild.backends.torch import graph_cache

MATERIAL = {"config": {"dim": 64, "n_layers": 2}, "shapes": [2, 16, 48], "device": "cpu",
            "tensors": {"layers.0.attention.wqkv.weight": [[128, 64], "torch.float32"]}, "plan": {}}


def test_the_architecture_key_follows_shapes_options_and_graph_but_not_the_weights_values() -> None:
    key = graph_cache.architecture_key("decode_b1", {"max_autotune": False}, MATERIAL)
    assert key == graph_cache.architecture_key("decode_b1", {"max_autotune": False}, dict(MATERIAL))
    wider = MATERIAL | {"tensors": {"layers.0.attention.wqkv.weight": [[256, 64], "torch.float32"]}}
    assert key != graph_cache.architecture_key("decode_b1", {"max_autotune": False}, wider)
    assert key != graph_cache.architecture_key("decode_b1", {"max_autotune": True}, MATERIAL)
    assert key != graph_cache.architecture_key("decode_b2", {"max_autotune": False}, MATERIAL)
    assert key != graph_cache.architecture_key("decode_b1", {"max_autotune": False}, MATERIAL | {"shapes": [2, 16, 64]})


def test_an_export_record_is_used_only_while_its_compiled_graph_is_complete(tmp_path: Path) -> None:
    digest = "ab" * 32
    graph = {"batch": 1, "window": "dynamic", "digest": digest, "program": object(), "export_s": 0.5}
    graph_cache.remember_export(tmp_path, "cd" * 32, graph_cache.export_record(graph))
    assert graph_cache.known_export(tmp_path, "cd" * 32) is None  # the compiled graph is not in the cache
    marker = graph_cache.cached(tmp_path, digest)
    marker.parent.mkdir(parents=True)
    marker.write_text("x.so\n")
    assert graph_cache.known_export(tmp_path, "cd" * 32) == {"batch": 1, "window": "dynamic", "digest": digest}
    assert graph_cache.known_export(tmp_path, "ef" * 32) is None


def test_a_cpu_engine_runs_one_step_program_and_a_gpu_engine_keeps_a_graph_each() -> None:
    from types import SimpleNamespace

    from trtbuild.backends.torch.export import shared_step

    shapes = SimpleNamespace(max_batch_size=4, max_input_len=64)
    assert shared_step("cpu", shapes) == (4, 64)  # the prefill and every bucket: any batch, any tokens
    assert shared_step("cuda", shapes) == shared_step("cuda:0", shapes) == (0, 0)
    assert graph_cache.architecture_key("decode_b1", {}, MATERIAL | {"step": [4, 64]}) != \
        graph_cache.architecture_key("decode_b1", {}, MATERIAL | {"step": [0, 0]})
