"""`trtbuild serve` over the paged KV cache, as a real process driven by the real `openai` client.

One tiny engine built with `options.kv_cache: paged`, served with paging, chunked prefill and prefix caching
each on and off (and with the row cache): every greedy stream must equal the eager model run on its prompt
alone, with streams of very different lengths side by side, and a pool too small for the load must make
requests wait or be preempted and recomputed, never fail.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from .test_serve import MAX_SEQ, VOCAB, _alone, _build_served, _metric, _start, _stop

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # builds an engine (minutes on 2 cores)

MODES = {
    # 12 blocks of 16 tokens: three sequences of the engine's full length, far fewer than the load below (the
    # CPU has no captured chunk graphs: --captured-chunks is said to do nothing)
    "paged-chunked-prefix": ["--kv-cache", "paged", "--kv-blocks", "12", "--prefill-chunk", "5", "--captured-chunks"],
    # the same with a step's chunks and decode rows in two calls, not one (the mixed step), each step's tokens
    # read back before the next is launched
    "paged-chunked-prefix-two-calls": ["--kv-cache", "paged", "--kv-blocks", "12", "--prefill-chunk", "5",
                                       "--no-mixed-step", "--no-overlap"],
    "paged-whole-prompts-no-prefix": ["--kv-cache", "paged", "--kv-blocks", "64", "--prefill-chunk", "0",
                                      "--no-prefix-cache"],
    "rows": ["--kv-cache", "rows"],
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _build_served(tmp_path_factory.mktemp("serve-paged"), options={"kv_cache": "paged"})


@pytest.fixture(scope="module", params=list(MODES))
def server(built: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    proc, port = _start(built["recipe"], built["engines"], 200, *MODES[request.param])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    out = ""
    try:
        yield built | {"port": port, "client": client, "mode": request.param}
    finally:
        code, out = _stop(proc)
        assert code == 0, out[-3000:]
    if request.param.startswith("paged"):
        assert "KV cache" in out and "paged:" in out, out[-2000:]
        calls = "two calls a step" if "--no-mixed-step" in MODES[request.param] else "one call a step"
        assert f"decode rows and prompt chunks in {calls}" in out, out[-2000:]
        launched = "after it" if "--no-overlap" in MODES[request.param] else "before the step before is read back"
        assert f"each step launched {launched}" in out, out[-2000:]
        said = "--captured-chunks: this engine has no captured chunk graphs" in out
        assert said == ("--captured-chunks" in MODES[request.param]), out[-2000:]


def _stream(client: Any, prompt: list[int], n: int) -> list[int]:
    stream = client.completions.create(model="served", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    return [t for chunk in stream for ch in chunk.choices for t in (ch.model_extra.get("token_ids") or [])]


def test_streams_of_very_different_lengths_under_load_get_their_own_tokens(server: dict[str, Any]) -> None:
    """24 streams at once, prompts of 1-32 tokens and outputs of 1-60: with 12 blocks the pool holds a few
    at a time, so requests wait for blocks or are preempted mid-decode; none fails, each gets its own tokens."""
    rng = random.Random(1)
    jobs = [([rng.randrange(VOCAB) for _ in range(rng.choice([1, 3, 17, 32]))], 0) for _ in range(24)]
    jobs = [(p, rng.randint(1, MAX_SEQ - len(p))) for p, _ in jobs]
    got: dict[int, Any] = {}

    def one(i: int) -> None:
        try:
            got[i] = _stream(server["client"], *jobs[i])
        except Exception as exc:  # noqa: BLE001 - reported below with its request
            got[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for i, (prompt, n) in enumerate(jobs):
        assert got.get(i) == _alone(server["folder"], prompt, n), f"request {i}: prompt of {len(prompt)}, {n} tokens"
    port = server["port"]
    assert _metric(port, 'trtbuild_requests_total{finish_reason="error"}') == 0
    if server["mode"] == "paged-chunked-prefix":
        assert _metric(port, "trtbuild_preemptions_total") > 0, "the load never ran the pool out of blocks"
        assert _metric(port, 'trtbuild_kv_blocks{state="used"}') == 0
        assert _metric(port, 'trtbuild_kv_blocks{state="free"}') == 12


def test_a_shared_prefix_is_served_from_the_cache_with_the_same_tokens(server: dict[str, Any]) -> None:
    system = [(11 * i + 5) % VOCAB for i in range(24)]  # one full block of 16, and more
    port = server["port"]
    hits = _metric(port, 'trtbuild_prefix_cache_blocks_total{result="hit"}')
    for q in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        assert _stream(server["client"], system + q, 6) == _alone(server["folder"], system + q, 6)
    gained = _metric(port, 'trtbuild_prefix_cache_blocks_total{result="hit"}') - hits
    assert gained == (2 if server["mode"].startswith("paged-chunked-prefix") else 0)


def test_the_startup_block_says_whether_launched_steps_replay_captured_mixed_graphs() -> None:
    """Where the engine captured graphs of the mixed step (CUDA) and serve uses them, the KV line says so; with
    --no-captured-mixed, or none captured (the CPU), it says one call a step."""
    from types import SimpleNamespace

    from trtbuild.serving.server import startup_lines

    outcome = SimpleNamespace(cache_hit=True, fleet={}, key="k", entry=SimpleNamespace(path="/e"))
    graphs = SimpleNamespace(graphs={(16, 1, 32): object()})
    engine = SimpleNamespace(max_seq_len=64, max_input_len=32, max_batch_size=1, kv_capacity_tokens=640,
                             kv_layout="paged: 40 blocks of 16 tokens", paged=SimpleNamespace(mixed_graphs=graphs),
                             captured_mixed=True, chunk_buckets=[])

    def kv_line() -> str:
        return startup_lines(SimpleNamespace(outcome=outcome), engine, [1], "http://h/v1", mixed=True, overlap=True)[2]

    assert "in one call a step, captured where a mixed graph holds it;" in kv_line()
    engine.captured_mixed = False
    assert "in one call a step;" in kv_line()
    engine.captured_mixed, graphs.graphs = True, {}
    assert "in one call a step;" in kv_line()
