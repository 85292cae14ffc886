"""options.prefill_attention: the choice between SDPA's dispatch and cuDNN's fused attention for the
prefill graph, on the CPU. cuDNN's kernel itself needs CUDA; its tokens against eager PyTorch are
tests/test_gpu.py's. Here: the export routes the model's prompt attention through the chosen op, the
build-time choice follows the timings and keeps them in the tactic cache."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY_CONFIG
from trtbuild.backends.torch import export, prefill_attention
from trtbuild.errors import TrtbuildError
from trtbuild.models.llama import Attention, LlamaConfig, Transformer, rope_table


def attention_ops(program: Any) -> list[str]:
    return sorted({str(n.target) for n in program.graph.nodes
                   if n.op == "call_function" and "dot_product" in str(n.target)})


def test_the_prefill_export_calls_the_routed_attention_and_the_switch_is_undone() -> None:
    """Exported with dynamic batch and prompt length (fake tensors, so on the CPU too): routed to cudnn,
    the program calls cuDNN's attention op with the KV heads as they are (GQA); otherwise SDPA."""
    cfg = LlamaConfig.from_hf(dict(TINY_CONFIG))
    assert cfg.num_kv_heads < cfg.num_heads
    model = Transformer(cfg, max_batch_size=2, max_seq_len=32, dtype=torch.float32).eval()
    model.rope = rope_table(cfg, 32)
    with prefill_attention.routed(model, "cudnn"):
        routed = export.export_prefill(model, 2, 16, "cpu")
    assert all(m.prefill_kernel == "sdpa" for m in model.modules() if isinstance(m, Attention))
    plain = export.export_prefill(model, 2, 16, "cpu")
    assert attention_ops(routed) == ["aten._scaled_dot_product_cudnn_attention.default"]
    assert attention_ops(plain) == ["aten.scaled_dot_product_attention.default"]


def fake_job(tmp_path: Path) -> Any:
    messages: list[str] = []
    return types.SimpleNamespace(tactics=types.SimpleNamespace(path=tmp_path), progress=messages.append,
                                 messages=messages)


@pytest.mark.parametrize("sdpa_us, cudnn_us, error, used", [
    (100.0, 60.0, None, "cudnn"), (100.0, 140.0, None, "sdpa"), (100.0, 98.0, None, "sdpa"),
    (100.0, 0.0, "cuDNN refused", "sdpa")])
def test_auto_takes_the_faster_kernel_and_a_rebuild_times_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                  sdpa_us: float, cudnn_us: float, error: str | None,
                                                                  used: str) -> None:
    """`measure` (CUDA) stood in for: auto follows its timings (a 2% lead is a tie, which keeps sdpa),
    falls back to sdpa where cuDNN failed, and a second plan with the same tactic cache reads the timing
    back instead of measuring again."""
    calls: list[list[int]] = []

    def measure(heads: int, kv: int, d: int, dtype: Any, lens: list[int]) -> dict[str, Any]:
        calls.append(lens)
        return {"lengths": lens, "sdpa_us": sdpa_us, "cudnn_us": cudnn_us,
                **({"cudnn_error": error} if error else {})}

    monkeypatch.setattr(prefill_attention, "measure", measure)
    cfg = LlamaConfig.from_hf(dict(TINY_CONFIG))
    job = fake_job(tmp_path)
    first = prefill_attention.plan(cfg, torch.bfloat16, "auto", "cuda", 2048, job)
    again = prefill_attention.plan(cfg, torch.bfloat16, "auto", "cuda", 2048, job)
    assert (first["used"], again["used"]) == (used, used)
    assert calls == [[128, 512, 2048]] and len(job.messages) == 1
    assert "reused" not in first["timings"] and again["timings"]["reused"] is True
    assert (error or f"{cudnn_us:.0f} us with cudnn") in first["note"]
    if error:
        with pytest.raises(TrtbuildError, match="options.prefill_attention: 'cudnn' cannot serve this model: cuDNN"):
            prefill_attention.plan(cfg, torch.bfloat16, "cudnn", "cuda", 2048, job)
    else:
        assert prefill_attention.plan(cfg, torch.bfloat16, "cudnn", "cuda", 2048, job)["used"] == "cudnn"


def test_sdpa_and_cpu_builds_time_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(prefill_attention, "measure", None)  # called, it would fail the test
    cfg = LlamaConfig.from_hf(dict(TINY_CONFIG))
    assert prefill_attention.plan(cfg, torch.bfloat16, "sdpa", "cuda", 2048, fake_job(tmp_path))["used"] == "sdpa"
    assert prefill_attention.plan(cfg, torch.float32, "auto", "cpu", 2048, fake_job(tmp_path))["used"] == "sdpa"
    assert list(tmp_path.iterdir()) == []


def test_lengths_cover_a_short_prompt_the_longest_and_a_quarter_of_it() -> None:
    assert prefill_attention.lengths(2048) == [128, 512, 2048]
    assert prefill_attention.lengths(8192) == [128, 1024, 4096]
    assert prefill_attention.lengths(16) == [16]


@pytest.mark.parametrize(("short", "used"), [((12.0, 105.0), "sdpa"), ((5.0, 5.8), "cudnn"), ((5.0, 6.2), "sdpa"),
                                            ((300.0, 302.5), "cudnn"), ((300.0, 303.5), "sdpa")])
def test_auto_keeps_sdpa_where_cudnn_is_slower_at_any_length_beyond_a_tie(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, short: tuple[float, float], used: str) -> None:
    """cuDNN ahead in total (its long prompts) but behind at the short prompt: sdpa is kept unless the short
    prompt's difference is a tie, 1% or 1 us a call, whichever is more (a few microseconds' attention a
    layer: 0.8 us is noise there, 1.2 us is not; at 300 us, 2.5 us is within 1% and 3.5 us is not)."""
    def measure(heads: int, kv: int, d: int, dtype: Any, lens: list[int]) -> dict[str, Any]:
        per = {"128": {"sdpa_us": short[0], "cudnn_us": short[1]}, "512": {"sdpa_us": 30.0, "cudnn_us": 28.0},
               "2048": {"sdpa_us": 400.0, "cudnn_us": 250.0}}
        return {"lengths": lens, "per_length": per, "sdpa_us": sum(v["sdpa_us"] for v in per.values()),
                "cudnn_us": sum(v["cudnn_us"] for v in per.values())}

    monkeypatch.setattr(prefill_attention, "measure", measure)
    cfg = LlamaConfig.from_hf(dict(TINY_CONFIG))
    chosen = prefill_attention.plan(cfg, torch.bfloat16, "auto", "cuda", 2048, fake_job(tmp_path))
    assert chosen["used"] == used and f"128: {short[1]:.0f}/{short[0]:.0f} us" in chosen["note"]
