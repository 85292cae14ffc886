"""`trtbuild serve` as a real process on a loopback port, driven by the real `openai` client.

One tiny fp32 engine (a byte-level BPE tokenizer, a chat template, EOS ids from generation_config.json)
is built once for the module and served by a `trtbuild serve --no-build` subprocess. Greedy tokens are
judged against the eager model run on each prompt alone (tests/engine_helpers.py), so a row that sees
another row's positions or cache, or a scheduler that feeds a row the wrong token, fails here.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, TINY_CONFIG, make_hf_folder, run_cli, tiny_recipe_doc, write_recipe

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # builds an engine (minutes on 2 cores)

VOCAB = 320
MAX_SEQ = 64
EOS = "<|eos|>"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _model_folder(root: Path) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer of exactly the model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = make_hf_folder(root / "model", dict(TINY_CONFIG, vocab_size=VOCAB, max_position_embeddings=MAX_SEQ))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world", "héllo wörld ünïcode ✓"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=[EOS],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([f"<|extra{i}|>" for i in range(VOCAB - tok.get_vocab_size())])
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(folder / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "chat_template": TEMPLATE,
                                                              "add_bos_token": False}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _post(port: int, path: str, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read()), dict(resp.getheaders())
    finally:
        conn.close()


def _start(recipe: Path, engines: Path, max_queue: int, *flags: str) -> tuple[subprocess.Popen[str], int]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trtbuild", "serve", str(recipe), "--engines", str(engines),
                             "--no-build", "--port", str(port), "--max-queue", str(max_queue), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}): {proc.stdout.read()[-3000:]}")  # type: ignore[union-attr]
        try:
            if _get(port, "/health")[0] == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("the server was not ready in 300 s")


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def _build_served(root: Path, **fields: Any) -> dict[str, Any]:
    """The tiny model's folder and the served recipe (with extra `fields`) built into root/engines by the CLI."""
    folder = _model_folder(root)
    doc = tiny_recipe_doc(name="served", model={"source": "./model"},
                          shapes={"max_batch_size": 4, "max_input_len": 32, "max_seq_len": MAX_SEQ,
                                  "batch_buckets": [1, 4]}, **fields)
    recipe = write_recipe(root, doc)
    engines = root / "engines"
    proc = run_cli("build", str(recipe), "--engines", str(engines), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "folder": folder, "recipe": recipe, "engines": engines}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _build_served(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(built: dict[str, Any]) -> Iterator[dict[str, Any]]:
    proc, port = _start(built["recipe"], built["engines"], max_queue=40)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    try:
        yield built | {"port": port, "client": client, "proc": proc}
    finally:
        code, out = _stop(proc)
        assert code == 0, out[-3000:]


def _alone(folder: Path, prompt: list[int], n: int) -> list[int]:
    from .engine_helpers import eager_greedy

    return eager_greedy(folder, [prompt], n, MAX_SEQ)[0]


def _metric(port: int, name: str) -> float:
    status, text = _get(port, "/metrics")
    assert status == 200
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_health_models_and_metrics(server: dict[str, Any]) -> None:
    assert _get(server["port"], "/health") == (200, '{"status":"ready"}')
    models = server["client"].models.list()
    assert [m.id for m in models.data] == ["served"]
    status, text = _get(server["port"], "/metrics")
    for name in ("trtbuild_time_to_first_token_seconds", "trtbuild_time_per_output_token_seconds",
                 "trtbuild_queue_length", "trtbuild_batch_occupancy", "trtbuild_requests_total",
                 "trtbuild_generation_tokens_total"):
        assert name in text


def test_completion_tokens_are_the_prompts_own(server: dict[str, Any]) -> None:
    prompt = [5, 17, 42, 99, 3]
    out = server["client"].completions.create(model="served", prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == _alone(server["folder"], prompt, 12)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 12 and out.usage.prompt_tokens == 5


def test_text_completion_and_streaming_agree(server: dict[str, Any]) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(server["folder"] / "tokenizer.json"))
    c = server["client"]
    whole = c.completions.create(model="served", prompt="hello world", max_tokens=10, temperature=0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = whole.choices[0].model_extra["token_ids"]
    assert ids == _alone(server["folder"], tok.encode("hello world").ids, 10)
    assert whole.choices[0].text == tok.decode(ids)
    pieces = list(c.completions.create(model="served", prompt="hello world", max_tokens=10, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"
    if "\ufffd" not in whole.choices[0].text:  # no piece ends inside a character the whole text completes
        assert all("\ufffd" not in p.choices[0].text for p in pieces)


def test_chat_with_and_without_streaming(server: dict[str, Any]) -> None:
    c = server["client"]
    messages = [{"role": "user", "content": "the fox"}]
    whole = c.chat.completions.create(model="served", messages=messages, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(model="served", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings(server: dict[str, Any]) -> None:
    c = server["client"]
    full = c.completions.create(model="served", prompt="the lazy dog", max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    printable = [i for i in range(4, len(full) - 2) if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2]]
    if not printable:
        pytest.skip(f"the tiny model's text has no printable pair to stop on: {full!r}")
    i = printable[0]
    stop = full[i:i + 2]
    cut = c.completions.create(model="served", prompt="the lazy dog", max_tokens=24, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    streamed = list(c.completions.create(model="served", prompt="the lazy dog", max_tokens=24, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_choices_seeded_sampling(server: dict[str, Any]) -> None:
    c = server["client"]
    kw: dict[str, Any] = dict(model="served", prompt=[7, 8, 9], max_tokens=10, temperature=1.0, top_p=0.95, seed=1234,
                              n=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    first = c.completions.create(**kw)
    again = c.completions.create(**kw)
    rows = [ch.model_extra["token_ids"] for ch in sorted(first.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(first.choices, key=lambda ch: ch.index)] == [0, 1, 2]
    assert rows == [ch.model_extra["token_ids"] for ch in sorted(again.choices, key=lambda ch: ch.index)]
    assert len({tuple(r) for r in rows}) > 1, "each choice draws with its own seed"
    greedy = c.completions.create(**(kw | {"temperature": 0.0, "n": 2}))
    assert [ch.model_extra["token_ids"] for ch in greedy.choices] == [_alone(server["folder"], [7, 8, 9], 10)] * 2


def test_32_concurrent_streams_each_get_their_own_tokens(server: dict[str, Any]) -> None:
    """More streams than rows, of different prompt and output lengths: every one completes with exactly the
    tokens its prompt gets alone."""
    import random

    rng = random.Random(0)
    jobs = [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))], rng.randint(1, 30)) for _ in range(32)]
    got: dict[int, Any] = {}

    def one(i: int) -> None:
        prompt, n = jobs[i]
        try:
            stream = server["client"].completions.create(
                model="served", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            got[i] = [t for chunk in stream for ch in chunk.choices for t in (ch.model_extra.get("token_ids") or [])]
        except Exception as exc:  # noqa: BLE001 - reported below with its request
            got[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (prompt, n) in enumerate(jobs):
        assert got.get(i) == _alone(server["folder"], prompt, n), f"request {i}: prompt of {len(prompt)}, {n} tokens"


def test_a_disconnect_mid_stream_frees_the_row(server: dict[str, Any]) -> None:
    port = server["port"]
    before = _metric(port, 'trtbuild_requests_total{finish_reason="cancelled"}')
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "served", "prompt": [1, 2, 3], "max_tokens": MAX_SEQ - 3, "temperature": 0, "stream": True,
            "ignore_eos": True}
    # several long streams at once, so that ours is still running (or waiting) when it goes
    others = [threading.Thread(target=_post, args=(port, "/v1/completions",
                                                   json.dumps(body | {"stream": False}).encode())) for _ in range(6)]
    for t in others:
        t.start()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    conn.close()
    for t in others:
        t.join(120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _metric(port, 'trtbuild_requests_total{finish_reason="cancelled"}') == before:
        time.sleep(0.1)
    assert _metric(port, 'trtbuild_requests_total{finish_reason="cancelled"}') == before + 1
    assert _metric(port, "trtbuild_running_requests") == 0 and _metric(port, "trtbuild_queue_length") == 0
    # the server still answers, and the freed row serves the next request correctly
    out = server["client"].completions.create(model="served", prompt=[4, 5], max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == _alone(server["folder"], [4, 5], 5)


def test_a_full_queue_answers_429_with_retry_after(server: dict[str, Any]) -> None:
    """4 rows and a queue of 40: 80 requests at once leave some without a place; those that got one finish."""
    gate = threading.Barrier(80)
    answers: list[Any] = []

    def one() -> None:
        gate.wait()
        try:
            answers.append(server["client"].completions.create(
                model="served", prompt=[9] * 8, max_tokens=MAX_SEQ - 8, temperature=0, extra_body={"ignore_eos": True}))
        except Exception as exc:  # noqa: BLE001 - sorted below
            answers.append(exc)

    threads = [threading.Thread(target=one) for _ in range(80)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    full = [a for a in answers if isinstance(a, openai.RateLimitError)]
    done = [a for a in answers if not isinstance(a, Exception)]
    assert len(full) + len(done) == 80, [a for a in answers if isinstance(a, Exception) and a not in full][:3]
    assert full, "no request met a full queue"
    assert int(full[0].response.headers["retry-after"]) >= 1
    assert full[0].body["type"] == "server_overloaded" and "queue is full" in full[0].body["message"]
    assert done and all(d.choices[0].finish_reason == "length" for d in done)


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "served", "prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"model": "served", "prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "served", "prompt": "hi", "n": 0}', 400, "n"),
    (b'{"model": "served"}', 400, "prompt"),
    (b'{"model": "served", "prompt": [1, 2], "max_tokens": 63}', 400, "max_seq_len of 64"),
    (b'{"model": "served", "prompt": [' + b", ".join([b"1"] * 33) + b"]}", 400, "max_input_len of 32"),
    (b'{"model": "served", "prompt": [320]}', 400, "vocabulary"),
    (b'{"model": "other", "prompt": "hi"}', 404, "not served here"),
    (b'{"model": "served", "prompt": "hi", "logprobs": 2}', 400, "logprobs"),
])
def test_malformed_requests_get_openai_errors(server: dict[str, Any], body: bytes, status: int, message: str) -> None:
    got, err, _ = _post(server["port"], "/v1/completions", body)
    assert got == status, err
    assert message in err["error"]["message"] and err["error"]["type"]
    assert _get(server["port"], "/health")[0] == 200  # and the server is still up


def test_unknown_paths_and_methods_get_openai_errors_and_every_refusal_is_counted(server: dict[str, Any]) -> None:
    port = server["port"]
    before = {r: _metric(port, f'trtbuild_requests_rejected_total{{reason="{r}"}}')
              for r in ("not_found", "method_not_allowed", "model_not_found", "invalid", "context_length")}
    got, err, _ = _post(port, "/v1/nothing", b"{}")
    assert got == 404 and "no such endpoint: /v1/nothing" in err["error"]["message"], err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == "not_found"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/completions")
    resp = conn.getresponse()
    err = json.loads(resp.read())
    conn.close()
    assert resp.status == 405 and "GET is not allowed on /v1/completions" in err["error"]["message"], err
    assert _post(port, "/v1/completions", b'{"model": "other", "prompt": "hi"}')[0] == 404
    assert _post(port, "/v1/completions", b"{not json")[0] == 400
    assert _post(port, "/v1/completions", b'{"model": "served", "prompt": [1, 2], "max_tokens": 63}')[0] == 400
    after = {r: _metric(port, f'trtbuild_requests_rejected_total{{reason="{r}"}}') for r in before}
    assert {r: after[r] - before[r] for r in before} == {"not_found": 1, "method_not_allowed": 1,
                                                         "model_not_found": 1, "invalid": 1, "context_length": 1}


def test_a_burst_fills_the_idle_rows_before_the_queue_bound_counts(built: dict[str, Any]) -> None:
    """4 idle rows and --max-queue 1: a burst of 12 gets at least 4 + 1 places; every other request is a 429
    counted in /metrics, none an error. The operator's start-up block says what is served and where."""
    proc, port = _start(built["recipe"], built["engines"], max_queue=1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    gate = threading.Barrier(12)
    answers: list[Any] = []

    def one() -> None:
        gate.wait()
        try:
            answers.append(client.completions.create(model="served", prompt=[9] * 8, max_tokens=MAX_SEQ - 8,
                                                     temperature=0, extra_body={"ignore_eos": True}))
        except Exception as exc:  # noqa: BLE001 - sorted below
            answers.append(exc)

    try:
        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        full = [a for a in answers if isinstance(a, openai.RateLimitError)]
        done = [a for a in answers if not isinstance(a, Exception)]
        assert len(full) + len(done) == 12, [a for a in answers if isinstance(a, Exception) and a not in full][:3]
        assert len(done) >= 5, f"only {len(done)} of 12 served with 4 idle rows and a queue of 1"
        assert _metric(port, 'trtbuild_requests_rejected_total{reason="queue_full"}') == len(full)
    finally:
        code, out = _stop(proc)
    assert code == 0, out[-3000:]
    assert "engine   " in out and "found in the local store" in out and str(built["engines"]) in out, out[-3000:]
    assert "decode buckets 1, 4; prompts up to 32 tokens, sequences up to 64" in out
    assert f"KV cache {4 * MAX_SEQ} tokens = 4 requests of the full {MAX_SEQ} tokens" in out
    assert f"ready on http://127.0.0.1:{port}/v1" in out


def test_openai_client_sees_a_too_long_request_as_bad_request(server: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError, match="max_input_len"):
        server["client"].completions.create(model="served", prompt=[1] * 40, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="messages"):
        server["client"].chat.completions.create(model="served", messages=[], max_tokens=4)


def test_sigterm_drains_running_streams(built: dict[str, Any]) -> None:
    proc, port = _start(built["recipe"], built["engines"], max_queue=8)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.completions.create(model="served", prompt=[3, 1, 4], max_tokens=MAX_SEQ - 3, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    it = iter(stream)
    first = next(it)
    proc.send_signal(signal.SIGTERM)
    rest = list(it)
    tokens = [t for chunk in [first, *rest] for ch in chunk.choices for t in (ch.model_extra.get("token_ids") or [])]
    assert tokens == _alone(built["folder"], [3, 1, 4], MAX_SEQ - 3)
    assert rest[-1].choices[0].finish_reason == "length"
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]


def test_serve_without_an_engine_and_no_build_is_one_clear_error(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_recipe_doc(name="absent"))
    proc = run_cli("serve", str(recipe), "--engines", str(tmp_path / "e"), "--no-build", "--port", str(_free_port()))
    assert proc.returncode != 0
    assert "Error:" in proc.stderr and "Traceback" not in proc.stderr
