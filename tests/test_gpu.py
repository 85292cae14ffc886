"""The same flow on CUDA: build a tiny engine, run decode through CUDA graphs, match eager tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trtbuild.builder import build
from trtbuild.recipe import load_recipe
from trtbuild.runner import open_session, run_report

from .conftest import TINY_CONFIG, tiny_recipe_doc, write_recipe
from .engine_helpers import eager_disagreements, eager_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_engine_matches_eager_and_replays_decode_in_a_cuda_graph(tmp_path: Path, precision: str) -> None:
    doc = tiny_recipe_doc(precision=precision, shapes={"max_batch_size": 2, "max_input_len": 16,
                                                      "max_seq_len": 48, "batch_buckets": [1, 2]})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    assert outcome.entry.manifest["key_material"]["device"]["kind"] == "cuda"
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        session.greedy(prompts, 1)  # the first token comes from prefill: no decode graph is captured
        assert not any(d.graphs for d in session.engine._decoders.values())
        got = session.greedy(prompts, 24)  # positions 8..30: the 24-slot window, then the 48-slot one
        assert all(sorted(d.graphs) == d.windows == [24, 48] for d in session.engine._decoders.values())
        report = run_report(session, batch_size=1, input_len=8, output_len=8, iterations=2)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    want = eager_greedy(outcome.model.materialize(), prompts, 24, 48, dtype=dtype, device="cuda")
    if precision == "fp32":
        assert got == want
    else:  # bf16: the default epilogue fusion sums in fp32 and rounds once, so a bf16 tie may go either way
        assert eager_disagreements(outcome.model.materialize(), prompts, [row[:8] for row in got], 48,
                                   dtype=dtype, device="cuda") == []
    assert report["device"].startswith("cuda") and report["tpot_ms"]["p50"] > 0


def test_prefill_graphs_replay_padded_prompts_and_give_the_tokens_of_the_direct_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRTBUILD_PREFILL_GRAPHS=2 (fp32): prompts are padded to the graphs' lengths (8 and 5 tokens share the
    16-row graph, 20 tokens take the 32-row one), each (bucket, length) is captured before its first prefill
    and replayed after, and every prompt, padded ones included, gets the eager model's tokens; a third
    shape drops the least recently used graph."""
    monkeypatch.setenv("TRTBUILD_PREFILL_GRAPHS", "2")
    doc = tiny_recipe_doc(shapes={"max_batch_size": 2, "max_input_len": 40, "max_seq_len": 64, "batch_buckets": [1, 2]})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    a, b, c = [[3, 1, 4, 1, 5, 9, 2, 6]], [[2, 7, 1, 8, 2, 8, 1, 8]], [[1, 2, 3, 4, 5]]
    d = [[(7 * i + 3) % 128 for i in range(20)]]
    prompts = (a, b, c, d, a)
    with open_session(recipe, tmp_path / "store", build=False) as session:
        engine = session.engine
        got = [session.greedy(p, 6) for p in prompts]
        assert engine.prefill_report()["lengths"] == {"prompt": 8, "graph": 16}
        assert engine.prefill_report()["shapes"] == [[1, 32], [1, 16]]  # (1, 16) used last
        assert engine.prefill_report()["captures_reserved_mib"] >= 0
        report = run_report(session, batch_size=2, input_len=8, output_len=4, iterations=2)
    assert report["prefill_launch"]["replayed"] is True
    assert report["prefill_launch"]["shapes"] == [[1, 16], [2, 16]]  # (1, 32) dropped
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == eager_greedy(outcome.model.materialize(), prompt, 6, 64, device="cuda")


def test_cuda_tactics_max_records_each_gemm_selection_quietly_and_matches_eager(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`max` on CUDA benchmarks Triton GEMM templates against cuBLAS per matmul shape: the manifest
    records every selection (candidates ranked, winner first), Inductor's own tables stay off the
    terminal, and the tokens are the eager model's."""
    doc = tiny_recipe_doc(shapes={"max_batch_size": 1, "max_input_len": 16, "max_seq_len": 32, "batch_buckets": [1]},
                          tactics={"level": "max"})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    tactics = outcome.entry.manifest["tactics"]
    assert tactics["inductor_configs"]["decode_b1"]["coordinate_descent_tuning"] is False
    assert tactics["inductor_configs"]["decode_b1"]["max_autotune"] is True
    assert "max_autotune" not in tactics["inductor_configs"]["prefill"]
    assert tactics["selections"] and all(s["winner"] == s["candidates"][0]["choice"] and s["num_candidates"] >= 2
                                         for s in tactics["selections"])
    assert "AUTOTUNE" not in capfd.readouterr().err
    prompts = [[5, 3, 9, 1, 7, 2]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        got = session.greedy(prompts, 12)
    want = eager_greedy(outcome.model.materialize(), prompts, 12, 32, device="cuda")
    # Triton's GEMMs sum in another order than cuBLAS: the leading tokens must agree
    assert [row[:6] for row in got] == [row[:6] for row in want]


@pytest.mark.parametrize("threads", [1, 4])
def test_threaded_reader_puts_the_same_tensors_on_the_gpu(tmp_path: Path, threads: int) -> None:
    """TRTBUILD_LOAD_THREADS's reader on CUDA (pinned staging buffers, one stream per thread) against
    safetensors' loader, with chunks small enough that each buffer is reused many times."""
    from safetensors.torch import load_file, save_file

    from trtbuild.backends.torch.weights_reader import read_safetensors

    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(1000, 517, generator=g).to(torch.bfloat16), "b": torch.randn(3, 5, generator=g),
               "c": torch.arange(77), "d": torch.zeros(0, 3)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    want = load_file(str(tmp_path / "w.safetensors"), device="cuda")
    got = read_safetensors(tmp_path / "w.safetensors", "cuda:0", threads, chunk_bytes=4096)
    assert got.keys() == want.keys()
    assert all(got[k].is_cuda and got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("threads", [1, 4])
def test_preload_puts_the_files_tensors_on_the_gpu_and_frees_them(tmp_path: Path, threads: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """weights_preload through the real CUDA driver: the tensors safetensors' loader gives, in memory
    torch adopted without a copy, freed again by `free` (the device's free memory comes back)."""
    from safetensors.torch import load_file, save_file

    from trtbuild.backends.torch import weights_preload

    g = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(8192, 4096, generator=g).to(torch.bfloat16), "b": torch.randn(3, 5, generator=g),
               "c": torch.arange(77), "d": torch.zeros(0, 3)}  # a: 64 MiB, enough to see in the free memory
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    want = load_file(str(path), device="cuda")
    torch.cuda.synchronize()
    monkeypatch.delenv("TRTBUILD_PRELOAD", raising=False)  # the default: on
    # Only the preload's memory may show in the device's free memory: the comparisons below run once first
    # (CUDA loads a kernel's module on its first launch, ~100 MiB that stayed after the first case's free on
    # the H200 and the H100, 2026-12-05), and torch's caching allocator is emptied before each reading
    assert all(torch.equal(want[k], want[k].clone()) for k in want)
    torch.cuda.empty_cache()
    before = torch.cuda.mem_get_info()[0]
    assert weights_preload.start(path, threads, chunk=1 << 20)
    got = weights_preload.take(path, "cuda:0")
    assert got is not None, "the preload failed or was refused"
    assert got.tensors.keys() == want.keys()
    assert all(got.tensors[k].is_cuda and got.tensors[k].dtype == want[k].dtype and torch.equal(got.tensors[k], want[k])
               for k in want)
    assert before - torch.cuda.mem_get_info()[0] >= 64 << 20
    del got.tensors
    got.free()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert abs(torch.cuda.mem_get_info()[0] - before) < 8 << 20


def test_a_restart_takes_the_weights_it_preloaded_while_torch_imported(tmp_path: Path) -> None:
    """`trtbuild run` in a new process, as a restart: its weights are read onto the GPU before torch is
    imported (the run report's load row says so), and its tokens are those of a run that reads them after."""
    from .conftest import read_json_line, run_cli

    doc = tiny_recipe_doc(precision="bf16", shapes={"max_batch_size": 1, "max_input_len": 16, "max_seq_len": 48,
                                                   "batch_buckets": [1]})
    path = write_recipe(tmp_path, doc)
    store = tmp_path / "store"
    build(load_recipe(path), store)
    runs = {}
    for preload in ("1", "0"):
        proc = run_cli("run", str(path), "--engines", str(store), "--no-build", "--json", env={"TRTBUILD_PRELOAD": preload})
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[preload] = read_json_line(proc.stdout)
    assert "during start-up" in runs["1"]["load_note"] and runs["0"]["load_note"] == ""
    assert runs["1"]["output_ids"] == runs["0"]["output_ids"]


@pytest.mark.parametrize("fusion", ["none", "split-k", "epilogue"])
def test_decode_kernel_is_compiled_into_the_decode_graphs_and_its_timings_are_reused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fusion: str) -> None:
    """options.decode_matmul kernel: every decode matmul goes through trtbuild's Triton kernel (chosen
    by timing its configurations over the model's weights), AOTInductor compiles it into the decode
    packages, the tokens are the eager model's, and a rebuild takes the timings from the tactic cache.
    With options.decode_fusion epilogue, the gating and the residual adds are in the kernel. With
    split-k (options.decode_split_k timed, the other candidates taken away), every matmul is split-K: two
    kernels inside the custom op, with a workspace of partial sums."""
    import json

    from trtbuild.kernels import matmul_configs
    from trtbuild.store.local import Store

    options = {"decode_matmul": "kernel", "decode_fusion": "epilogue" if fusion == "epilogue" else "none"}
    if fusion == "split-k":
        options["decode_split_k"] = "timed"
        monkeypatch.setattr(matmul_configs, "ONE_ROW", [])
        monkeypatch.setattr(matmul_configs, "ROWS", [])
    doc = tiny_recipe_doc(precision="bf16", tactics={"level": "default"}, options=options,
                          shapes={"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [1, 2]})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    record = outcome.entry.manifest["tactics"]["decode_matmuls"]
    assert sorted(record) == ["decode_b1", "decode_b2"]
    for shapes in record.values():
        assert shapes and all(r["used"] != "cublas" and r.get("reused") is not True and r["cublas_us"] > 0
                              for r in shapes.values())
        assert all(("p" in r["used"]) == (fusion == "split-k") for r in shapes.values())
        fusions = sorted(key.partition("+")[2] for key in shapes)
        # five call sites; without fusion, gate/up and the LM head are one key (both 128x32 here)
        assert fusions == (["", "", "gate", "residual", "residual"] if fusion == "epilogue" else [""] * 4)
    engine = json.loads((outcome.entry.path / "engine.json").read_text())
    assert all(len(engine["graphs"][g]["matmuls"]) == len(record[g]) for g in record)
    assert engine["graphs"]["prefill"].get("matmuls") is None  # prefill keeps cuBLAS
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        got = session.greedy(prompts, 16)
        one = session.greedy(prompts[:1], 16)
    # each token eager's best given the engine's tokens before it, within bf16 rounding: the kernels sum in
    # fp32 and round once, and this model's third token is a bf16 tie (tests/test_eager_reference.py)
    folder = outcome.model.materialize()
    assert eager_disagreements(folder, prompts, [row[:8] for row in got], 48, dtype=torch.bfloat16, device="cuda") == []
    assert eager_disagreements(folder, prompts[:1], [one[0][:8]], 48, dtype=torch.bfloat16, device="cuda") == []

    Store(tmp_path / "store").remove(outcome.entry)
    again = build(recipe, tmp_path / "store")
    assert all(r["reused"] is True for shapes in again.entry.manifest["tactics"]["decode_matmuls"].values()
               for r in shapes.values())


def test_prefill_attention_through_cudnn_is_compiled_into_the_prefill_graph_and_matches_eager(tmp_path: Path) -> None:
    """options.prefill_attention cudnn on a bf16 GQA model (4 query heads, 2 KV heads of 16): the build
    timed both kernels, the prefill graph calls cuDNN's attention with a dynamic prompt length (two
    lengths here), and the leading tokens are the eager model's at both batch sizes."""
    import json

    from .conftest import TINY_CONFIG

    doc = tiny_recipe_doc(precision="bf16", options={"prefill_attention": "cudnn", "decode_matmul": "cublas"},
                          shapes={"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [1, 2]})
    doc["model"]["config"] = {**TINY_CONFIG, "hidden_size": 64}
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    chosen = outcome.entry.manifest["tactics"]["prefill_attention"]
    assert chosen["used"] == "cudnn" and chosen["timings"]["cudnn_us"] > 0, chosen
    engine = json.loads((outcome.entry.path / "engine.json").read_text())
    assert engine["graphs"]["prefill"]["prefill_attention"] == "cudnn"
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        got = session.greedy(prompts, 12)
        short = session.greedy([prompts[0][:5]], 12)
    want = eager_greedy(outcome.model.materialize(), prompts, 12, 48, dtype=torch.bfloat16, device="cuda")
    want_short = eager_greedy(outcome.model.materialize(), [prompts[0][:5]], 12, 48, dtype=torch.bfloat16, device="cuda")
    assert [row[:4] for row in got] == [row[:4] for row in want]  # bf16 sums in another order
    assert short[0][:4] == want_short[0][:4]


def test_decode_attention_kernel_is_compiled_into_the_decode_graphs_and_matches_eager(tmp_path: Path) -> None:
    """options.decode_attention kernel (rope and the cache writes in the kernel) on a
    bf16 model with head_dim 16 (the kernel's smallest): the decode graphs call trtbuild's attention kernel,
    prefill keeps SDPA, and the leading tokens are the eager model's, across two cache windows and at both
    batch sizes (so the cache the kernel writes is what later steps and windows read)."""
    import json

    from .conftest import TINY_CONFIG

    mode = "kernel"
    doc = tiny_recipe_doc(precision="bf16", options={"decode_attention": mode, "decode_matmul": "cublas"},
                          shapes={"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [1, 2]})
    doc["model"]["config"] = {**TINY_CONFIG, "hidden_size": 64}  # 4 heads of 16
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    assert outcome.entry.manifest["tactics"]["decode_attention"]["used"] == mode
    engine = json.loads((outcome.entry.path / "engine.json").read_text())
    assert [engine["graphs"][g].get("attention") for g in ("prefill", "decode_b1", "decode_b2")] == [None, mode, mode]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        got = session.greedy(prompts, 24)
        one = session.greedy(prompts[:1], 24)
    want = eager_greedy(outcome.model.materialize(), prompts, 24, 48, dtype=torch.bfloat16, device="cuda")
    assert [row[:4] for row in got] == [row[:4] for row in want]  # bf16 sums in another order
    assert one[0][:4] == want[0][:4]


def test_decode_graphs_launch_with_pdl_and_give_the_tokens_of_serialized_graphs(tmp_path: Path) -> None:
    """Programmatic dependent launch (trtbuild/backends/torch/pdl.py) on Hopper: the decode graphs of an
    engine whose matmuls and attention go through trtbuild's kernels are captured with programmatic
    edges into those kernels and Inductor's, and every token equals the same engine's with its graphs
    captured serialized (TRTBUILD_PDL=0), at both batch sizes, across two cache windows."""
    import json
    import os

    from trtbuild.backends.torch import pdl

    from .conftest import TINY_CONFIG

    if pdl.available(torch.cuda.get_device_capability) is not None:
        pytest.skip(f"no PDL here: {pdl.available(torch.cuda.get_device_capability)}")
    doc = tiny_recipe_doc(precision="bf16", tactics={"level": "default"},
                          options={"decode_matmul": "kernel", "decode_attention": "kernel"},
                          shapes={"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [1, 2]})
    doc["model"]["config"] = {**TINY_CONFIG, "hidden_size": 64}  # 4 heads of 16: the attention kernel serves it
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    engine = json.loads((outcome.entry.path / "engine.json").read_text())
    inductor = os.environ.get("TRTBUILD_INDUCTOR_PDL", "1") != "0"  # the switch a device call may set
    assert [engine["graphs"][g].get("pdl") for g in ("prefill", "decode_b1", "decode_b2")] == [False, inductor, inductor]
    assert [engine["graphs"][g].get("trtbuild_wait") for g in ("prefill", "decode_b1", "decode_b2")] == [False, True, True]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]
    runs = {}
    for allowed in (True, False):
        with open_session(recipe, tmp_path / "store", build=False) as session:
            session.engine.pdl_allowed = allowed
            runs[allowed] = (session.greedy(prompts, 24), session.greedy(prompts[:1], 24))
            report = session.engine.launch_report()
        assert sorted(report) == ["decode_b1", "decode_b2"]
        for r in report.values():
            assert r["on"] is allowed, r
            if allowed:
                assert r["inductor"] is inductor and r["programmatic_edges"] > 0 and r["kernels"] > r["programmatic_edges"], r
                # cuBLAS's GEMMs never wait, so none may start early; trtbuild's kernels all may
                assert not any(name.startswith(pdl.OWN_KERNELS) for name in r["serialized_kernels"]), r
    assert runs[True] == runs[False]
    # the default epilogue fusion sums in fp32 and rounds once: tokens judged within bf16 rounding
    assert eager_disagreements(outcome.model.materialize(), prompts, [row[:8] for row in runs[True][0]], 48,
                               dtype=torch.bfloat16, device="cuda") == []


def test_paged_decode_through_the_kernel_replays_bucket_graphs_with_the_direct_calls_tokens(tmp_path: Path) -> None:
    """A bf16 paged engine (head_dim 16, so the paged graph calls the Triton paged attention): three prompts of
    different lengths prefilled together through scattered block tables, then decode steps of all three, which replay
    the 4-row bucket's captured graph (one padding row on the scratch block). The tokens equal those of the
    same padded step called without a graph, the scratch block is the only block no row owns that changed.
    Then a fourth prompt is prefilled in two chunks by the mixed step, beside the three rows' decode steps, and
    all four decode on, then in launched steps, each fed on the device from the one before, two of which carry
    a fifth prompt's chunks through a captured chunk graph, then two more carrying a sixth prompt's chunks
    beside the five rows through a captured graph of the mixed step. Each row's tokens (the fifth's and the
    sixth's first) are the eager model's (within bf16 ties)."""
    from trtbuild.backends.sampling import GREEDY
    from trtbuild.backends.torch.paged_graphs import PagedDecodeGraphs
    from trtbuild.models.paged import BLOCK

    config = dict(TINY_CONFIG, hidden_size=64, max_position_embeddings=96)
    doc = tiny_recipe_doc(precision="bf16", options={"kv_cache": "paged"},
                          model={"source": "synthetic", "seed": 0, "config": config},
                          shapes={"max_batch_size": 2, "max_input_len": 32, "max_seq_len": 96, "batch_buckets": [1, 2]})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    prompts = [[(7 * i + 3) % 128 for i in range(29)], [2, 7, 1], [(5 * i + 1) % 128 for i in range(17)]]
    tables = [[9, 2, 6, 0, 11, 30], [4, 10, 1, 7, 31, 32], [12, 13, 14, 15, 16, 17]]
    steps = 24
    with open_session(recipe, tmp_path / "store", build=False) as session:
        engine = session.engine
        engine.open_pool(blocks=40)
        paged = engine.paged
        assert paged.graphs is not None and paged.graphs.sizes[-1] == 64
        direct = PagedDecodeGraphs(paged.package, [p.clone() for p in paged.pools], paged.device,
                                   paged.graphs.width, paged.scratch, 40)
        direct.capturable = False
        # the three prompts in one call: left-padded to the longest, the padding on the scratch block
        firsts = engine.prefill_paged([0, 1, 2], tables, prompts, [0, 0, 0], [GREEDY] * 3, [True] * 3)
        streams: list[list[int]] = [[t] for t in firsts]
        for mine, theirs in zip(direct.pools, paged.pools):  # the direct path starts from the same prefilled pools
            mine.copy_(theirs)
        before = [p.clone() for p in paged.pools]
        want = [list(s) for s in streams]
        for i in range(steps):
            positions = [len(p) + i for p in prompts]
            got = engine.decode_paged([0, 1, 2], tables, [s[-1] for s in streams], positions, [GREEDY] * 3)
            rows = [t[:-(-(p + 1) // BLOCK)] for t, p in zip(tables, positions)]
            greedy, _ = direct.run(rows, [s[-1] for s in want], positions)
            for s, w, tok, ref in zip(streams, want, got, greedy[:, 0].tolist()):
                s.append(tok)
                w.append(ref)
        assert sorted(paged.graphs.graphs) == [4]
        owned = {b for t in tables for b in t}
        for now, then in zip(paged.pools, before):
            for block in range(40):
                if block not in owned:
                    assert torch.equal(now[block], then[block]), block
        assert streams == want
        # the mixed step: a fourth prompt prefilled in two chunks beside the three rows' decode steps, one call
        # each, then four rows decoding
        assert engine.can_mix
        late, late_table = [(3 * i + 2) % 128 for i in range(20)], [18, 19, 20, 21, 22, 23]
        for a, b in ((0, 12), (12, 20)):
            positions = [len(p) + len(st) - 1 for p, st in zip(prompts, streams)]
            dec, firsts = engine.step_paged(([0, 1, 2], tables, [st[-1] for st in streams], positions, [GREEDY] * 3),
                                            ([3], [late_table], [late[a:b]], [a], [GREEDY], [b == len(late)]))
            for st, tok in zip(streams, dec):
                st.append(tok)
        streams.append([firsts[0]])
        everyone, tables = prompts + [late], tables + [late_table]
        for _ in range(4):
            positions = [len(p) + len(st) - 1 for p, st in zip(everyone, streams)]
            for st, tok in zip(streams, engine.decode_paged([0, 1, 2, 3], tables, [st[-1] for st in streams],
                                                            positions, [GREEDY] * 4)):
                st.append(tok)
        # launched steps (serve's overlap): each read back after the next is launched, whose tokens the device
        # copies from the step before's output into the bucket graph's input before the replay; a fifth prompt
        # prefilled beside them in two chunks through a captured chunk graph (serve --captured-chunks)
        engine.captured_chunks = True
        assert engine.chunk_buckets
        fifth, fifth_table, fifth_first = [(11 * i + 5) % 128 for i in range(20)], [24, 25, 26, 27, 28, 29], None
        before = None
        for i in range(6):
            positions = [len(p) + len(st) - 1 + (before is not None) for p, st in zip(everyone, streams)]
            fed = [] if before is None else [(j, j) for j in range(4)]
            chunks = (([4], [fifth_table], [fifth[:12]], [0], [GREEDY], [False]) if i == 1 else
                      ([4], [fifth_table], [fifth[12:]], [12], [GREEDY], [True]) if i == 2 else None)
            step = engine.launch_paged(([0, 1, 2, 3], tables, [st[-1] for st in streams], positions, [GREEDY] * 4),
                                       chunks, fed)
            if before is not None:
                decoded, firsts = before.result()
                for st, tok in zip(streams, decoded):
                    st.append(tok)
                fifth_first = firsts[0] if firsts and firsts[0] is not None else fifth_first
            before = step
        for st, tok in zip(streams, before.result()[0]):
            st.append(tok)
        assert (1, 16) in paged.chunks.graphs and fifth_first is not None
        everyone, streams = everyone + [fifth], streams + [[fifth_first]]
        # and a sixth prompt's chunks beside the five rows through a captured graph of the mixed step (serve's
        # default for launched steps)
        engine.captured_chunks = False
        sixth, sixth_table, sixth_first = [(13 * i + 7) % 128 for i in range(20)], [33, 34, 35, 36, 37, 38], None
        before = None
        for i in range(6):
            positions = [len(p) + len(st) - 1 + (before is not None) for p, st in zip(everyone, streams)]
            fed = [] if before is None else [(j, j) for j in range(5)]
            chunks = (([5], [sixth_table], [sixth[:12]], [0], [GREEDY], [False]) if i == 1 else
                      ([5], [sixth_table], [sixth[12:]], [12], [GREEDY], [True]) if i == 2 else None)
            step = engine.launch_paged(([0, 1, 2, 3, 4], tables + [fifth_table], [st[-1] for st in streams],
                                        positions, [GREEDY] * 5), chunks, fed)
            if before is not None:
                decoded, firsts = before.result()
                for st, tok in zip(streams, decoded):
                    st.append(tok)
                sixth_first = firsts[0] if firsts and firsts[0] is not None else sixth_first
            before = step
        for st, tok in zip(streams, before.result()[0]):
            st.append(tok)
        # five rows in the 16-row bucket; the 12- and 8-token chunks in the smallest chunk bucket, 32 tokens
        assert list(paged.mixed_graphs.graphs) == [(16, 1, 32)] and sixth_first is not None
        everyone, streams = everyone + [sixth], streams + [[sixth_first]]
    folder = outcome.model.materialize()
    for prompt, stream in zip(everyone, streams):
        assert eager_disagreements(folder, [prompt], [stream], 96, dtype=torch.bfloat16, device="cuda") == []


def test_an_engine_compiled_by_regions_replays_its_chain_in_cuda_graphs_with_the_eager_tokens(tmp_path: Path) -> None:
    """Six bf16 layers (regions: layers 0-4 in one program, the last in another; trtbuild's decode kernels in
    both): prefill through the captured prefill graphs and decode through the bucket graphs, each a chain of six
    region calls and the embedding; every token is the eager model's (within bf16 ties), and the paged graph's
    chain gives the same first tokens as the row cache."""
    from trtbuild.backends.sampling import GREEDY

    config = dict(TINY_CONFIG, hidden_size=64, num_hidden_layers=6, max_position_embeddings=96)
    doc = tiny_recipe_doc(precision="bf16", options={"kv_cache": "paged"},
                          model={"source": "synthetic", "seed": 0, "config": config},
                          shapes={"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [1, 2]})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    import json

    spec = json.loads((outcome.entry.path / "engine.json").read_text())
    assert [r["layers"] for r in spec["graphs"]["decode_b2"]["regions"]] == [[0, 1, 2, 3, 4], [5]]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        got = session.greedy(prompts, 24)
        assert all(d.graphs for d in session.engine._decoders.values())
        engine = session.engine
        engine.open_pool(blocks=12)
        firsts = engine.prefill_paged([0, 1], [[3, 1], [0, 7]], prompts, [0, 0], [GREEDY] * 2, [True] * 2)
    assert firsts == [row[0] for row in got]
    assert eager_disagreements(outcome.model.materialize(), prompts, got, 48, dtype=torch.bfloat16,
                               device="cuda") == []
