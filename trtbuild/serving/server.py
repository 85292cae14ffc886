"""`trtbuild serve`: an OpenAI-compatible HTTP server over a prebuilt engine, with continuous batching.

FastAPI in uvicorn's event loop answers HTTP; one engine thread loads the engine, warms every decode
bucket, then runs the scheduler (scheduler.py). Requests reach the scheduler as token ids with their
sampling and stop conditions; tokens come back into a queue per HTTP request, as text that the engine thread
has already made safe to emit (generate.py's detokenizer), handed to the event loop once a step (Outbox).

Errors are OpenAI's error object: 400 for malformed JSON, wrong types and requests that do not fit the
engine (the message names the limit), 404 for another model's name, 429 with Retry-After when the queue
is full, 503 while loading or draining. SIGTERM (or Ctrl-C) stops accepting, lets running requests end,
then exits.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at runtime, and the
# request type is imported inside create_app (the web libraries load only when a server starts).
import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from trtbuild.errors import InputError, TrtbuildError
from trtbuild.serving.openai_api import (ApiError, chunk, finish_reason, flat_message, parse, request_models, response, sse,
                                 usage_chunk)
from trtbuild.serving.scheduler import Event, QueueFull, Request, Scheduler, ShuttingDown

log = logging.getLogger("trtbuild.serving.server")

INSTALL_HINT = "pip install -e .  (FastAPI, uvicorn and prometheus_client are trtbuild's dependencies)"


def require() -> None:
    """InputError naming the install step when the server's libraries are missing."""
    missing = []
    for name in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise InputError(f"trtbuild serve needs {', '.join(missing)}, not installed here", hint=INSTALL_HINT)


# How many rows a paged step may hold (backends/torch/export.PAGED_ROWS), by the powers of two the metrics use.
PAGED_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# Python's GIL switch interval while serving (its default is 5 ms). The engine thread gives the GIL up at every
# torch op and at every wait for the device, and takes it back from an event loop that, with hundreds of
# streams, is rarely idle: it then waits for the loop's interval to run out, several times a step. With a
# device step faked by sleeps and 256 streaming clients (benchmarks/server_host_bench.py, 2 cores), the host's
# share of a step fell from 7.3 to 4.4 ms; 16 clients were unchanged.
SWITCH_INTERVAL_S = 0.0002


@dataclass(frozen=True)
class KvSettings:
    """The serve command's KV-cache flags (docs/serve.md): which cache, the pool's size, chunking, prefix caching."""

    cache: str = "auto"  # auto: paged where the engine has the paged graph; paged; rows
    memory: float = 0.9  # the fraction of the memory left after the weights that the pool takes
    blocks: int | None = None  # the pool's blocks, overriding `memory`
    chunk: int = 512  # prompt tokens prefilled a step beside the decode rows; 0: a whole prompt at once
    prefix: bool = True  # prefix caching
    mixed: bool = True  # a step's decode rows and prompt chunks in one call, where the engine has the mixed step
    overlap: bool = True  # each step launched before the step before is read back (Scheduler._launch)
    # a step's prompt chunks replayed from their captured graphs beside the decode rows', planned to their shapes,
    # instead of the uncaptured mixed step (PagedSlots.captured_chunks)
    captured_chunks: bool = False
    # a launched step's decode rows and chunks replayed from a captured graph of the mixed step, where a bucket
    # holds them with little padding (PagedSlots.captured_mixed)
    captured_mixed: bool = True
    # which prompts a step prefills first: "shortest" (fewest tokens left first; a burst's short prompts do not
    # wait for its long ones) or "arrival" (admission order)
    prefill_order: str = "shortest"


# -- the server -----------------------------------------------------------------------------------------------
class Outbox:
    """The engine thread's events on their way to the HTTP handlers' queues, handed over once a scheduler step
    (and at once after a first token): one wake-up of the event loop a step rather than one a token. Each
    wake-up is a system call made holding the GIL, which the HTTP side waits for. Engine thread only."""

    def __init__(self) -> None:
        self._items: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any], Any]] = []

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any], item: Any) -> None:
        self._items.append((loop, queue, item))

    def flush(self) -> None:
        if not self._items:
            return
        items, self._items = self._items, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for loop, queue, item in items:
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop has closed (the server is exiting): nobody is left to read them
                continue


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class Server:
    """The engine thread and the state the HTTP handlers read. `status`: loading, ready, draining, failed."""

    def __init__(self, session: Any, max_queue: int = 256, on_fail: Callable[[], None] = lambda: None,
                 url: str = "", announce: Callable[[str], None] = lambda line: None,
                 kv: KvSettings | None = None) -> None:
        from trtbuild.serving.metrics import Metrics

        self.session = session
        self.name: str = session.recipe.name
        self.max_queue = max_queue
        self.metrics = Metrics(self.name)
        self.status = "loading"
        self.failure = ""
        self.scheduler: Scheduler | None = None
        self.text: Any = None  # generate.py's text side: encode, chat, eos ids, watches
        self.created = int(time.time())
        self._on_fail = on_fail
        self.url = url
        self.kv = kv or KvSettings()
        self._announce = announce  # the operator's start-up lines (stderr), once the engine is ready
        self.outbox = Outbox()
        self._thread = threading.Thread(target=self._engine_thread, name="trtbuild-engine", daemon=True)
        self._done = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def _engine_thread(self) -> None:
        try:
            with self.session as session:
                engine = session.engine
                if not all(callable(getattr(engine, m, None)) for m in ("prefill", "decode", "release")):
                    raise TrtbuildError(f"the {session.recipe.backend} backend's engines have no slot API "
                                        "(prefill, decode, release), which serving needs",
                                        hint="serve a recipe with `backend: torch`")
                self.text = _text_side(session)
                pool = self._open_pool(engine)
                buckets = PAGED_BUCKETS if pool is not None else self._buckets(engine)
                if pool is None:
                    _warm(engine, buckets)
                else:
                    _warm_paged(engine)
                elem = {"fp32": 4, "fp16": 2, "bf16": 2}.get(session.recipe.precision, 2)
                self.metrics.describe_engine(engine, elem)
                self.scheduler = Scheduler(engine, self.max_queue, buckets, self.metrics, pool=pool,
                                           chunk_tokens=self.kv.chunk or None, flush=self.outbox.flush,
                                           mixed=self.kv.mixed, overlap=self.kv.overlap,
                                           prefill_order=self.kv.prefill_order)
                # Everything loaded so far (torch, the engine, the tokenizer: ~225k objects) lives as long as the
                # server: out of the collector's reach, a full collection no longer walks it while it holds the
                # GIL (~50 ms on a 2-core host, 2026-12-06; after the freeze, well under 1 ms)
                gc.collect()
                gc.freeze()
                self.status = "ready"
                self.metrics.ready.set(1)
                for line in startup_lines(session, engine, buckets, self.url, self.scheduler.mixed,
                                          self.scheduler.overlap, self.kv.captured_chunks):
                    self._announce(line)
                self.scheduler.run()
        except BaseException as exc:  # nothing to serve: say why and make uvicorn exit
            self.failure = str(exc) if isinstance(exc, TrtbuildError) else f"{type(exc).__name__}: {exc}"
            log.error("the engine could not be loaded: %s", self.failure, exc_info=not isinstance(exc, TrtbuildError))
            self.status = "failed"
            self._on_fail()
        finally:
            self.metrics.ready.set(0)
            self._done.set()

    def _open_pool(self, engine: Any) -> Any:
        """The block pool where the engine pages its KV cache (kv_blocks.BlockPool), or None for the row cache."""
        can = bool(getattr(engine, "can_page", False))
        if self.kv.cache == "rows" or (self.kv.cache == "auto" and not can):
            return None
        if not can:
            raise TrtbuildError("--kv-cache paged: this engine has no paged graph",
                                hint="build the recipe with `options: {kv_cache: paged}` (backend torch)")
        from trtbuild.serving.kv_blocks import BlockPool

        n = engine.open_pool(self.kv.memory, self.kv.blocks, captured_chunks=self.kv.captured_chunks,
                             captured_mixed=self.kv.captured_mixed)
        return BlockPool(n, engine.paged.block_size, prefix_caching=self.kv.prefix)

    @staticmethod
    def _buckets(engine: Any) -> list[int]:
        return list(getattr(engine, "buckets", None) or [engine.max_batch_size])

    def drain(self, timeout: float | None = None) -> None:
        """No new requests; the engine thread ends once the queued and running ones have."""
        if self.status == "ready":
            self.status = "draining"
        if self.scheduler is not None:
            self.scheduler.stop(drain=True)
        self._done.wait(timeout)

    # -- one HTTP request's generations ------------------------------------------------------------------------
    def check_ready(self, params: Any) -> Scheduler:
        if params.model not in (None, self.name):
            raise ApiError(404, f"model '{params.model}' is not served here; this server serves '{self.name}'",
                           param="model", code="model_not_found", reason="model_not_found")
        if self.status != "ready" or self.scheduler is None:
            why = {"loading": "the engine is still loading", "draining": "the server is shutting down",
                   "failed": f"the engine failed to load: {self.failure}"}[self.status]
            raise ApiError(503, why, "server_unavailable", headers={"Retry-After": "5"}, reason=self.status)
        return self.scheduler

    def requests(self, prompts: list[list[int]], params: Any, max_tokens: int | None, default_max: int | None,
                 emit: Callable[[int, Event], None]) -> list[Request]:
        """One scheduler Request a choice: `n` per prompt, choice index = prompt index * n + j."""
        from trtbuild.backends.sampling import Sampling

        scheduler = self.check_ready(params)
        engine = scheduler.engine
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        if stops and not self.text.can_detokenize:
            raise ApiError(400, "stop: stop strings need the model's tokenizer, which this engine lacks", param="stop")
        eos = frozenset() if params.ignore_eos else frozenset(self.text.eos_ids)
        stop_ids = eos | frozenset(params.stop_token_ids or [])
        out = []
        for p, prompt in enumerate(prompts):
            room = engine.max_seq_len - len(prompt)
            want = max_tokens if max_tokens is not None else min(default_max or room, room)
            for j in range(params.n):
                sampling = Sampling(temperature=params.temperature, top_k=max(params.top_k, 0), top_p=params.top_p,
                                    seed=None if params.seed is None else params.seed + j,
                                    repetition_penalty=params.repetition_penalty,
                                    presence_penalty=params.presence_penalty)
                index = p * params.n + j
                out.append(Request(prompt=prompt, max_tokens=want, sampling=sampling, stop_ids=stop_ids,
                                   watch=self.text.watch(stops, prompt) if self.text.can_detokenize else None,
                                   on_event=lambda ev, i=index: emit(i, ev)))
        if len(out) > self.max_queue:
            raise ApiError(400, f"n: {len(out)} generations in one request, more than the server's queue of "
                           f"{self.max_queue}", param="n")
        return out

    def submit(self, reqs: list[Request]) -> None:
        assert self.scheduler is not None
        try:
            self.scheduler.submit_all(reqs)
        except InputError as exc:
            param = "max_tokens" if exc.message.startswith("max_tokens") else "prompt"
            long = "max_" in exc.message
            raise ApiError(400, exc.message, param=param, code="context_length_exceeded" if long else None,
                           reason="context_length" if long else "invalid") from None
        except QueueFull as exc:
            raise ApiError(429, f"{exc.message}; retry later", "server_overloaded",
                           headers={"Retry-After": str(round(exc.retry_after_s))}) from None
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", "server_unavailable",
                           headers={"Retry-After": "5"}, reason="draining") from None


def startup_lines(session: Any, engine: Any, buckets: list[int], url: str, mixed: bool = False,
                  overlap: bool = False, captured: bool = False) -> list[str]:
    """What an operator reads at start: the engine and where it came from, its shapes, the KV cache's
    capacity (and, paged, whether a step's decode rows and prompt chunks go in one call: `mixed`, or in two
    captured ones; whether a step is launched before the one before is read back: `overlap`; whether captured
    chunk graphs were asked for and are not there: `captured`), and where it listens."""
    outcome = session.outcome
    if not outcome.cache_hit:
        where = "built now"
    elif outcome.fleet.get("tier") == "remote":
        where = f"pulled from {outcome.fleet.get('url')}"
    else:
        where = "found in the local store"
    full = engine.max_seq_len
    tokens = int(getattr(engine, "kv_capacity_tokens", engine.max_batch_size * full))
    layout = getattr(engine, "kv_layout", f"{engine.max_batch_size} rows of {full} tokens")
    if getattr(engine, "paged", None) is not None:
        layout += "; decode rows and prompt chunks in " + (
            "two captured calls a step where a chunk graph holds the chunks" if mixed and getattr(
                engine, "chunk_buckets", None) else
            "one call a step, captured where a mixed graph holds it" if mixed and _mixed_graphs(engine) else
            "one call a step" if mixed else "two calls a step")
        layout += "; each step launched " + ("before the step before is read back" if overlap else "after it")
        if captured and not getattr(engine, "chunk_buckets", None):
            layout += "; --captured-chunks: this engine has no captured chunk graphs (CUDA only)"
    return [f"engine   {outcome.key} ({where}: {outcome.entry.path})",
            f"shapes   decode buckets {', '.join(map(str, buckets))}; prompts up to {engine.max_input_len} "
            f"tokens, sequences up to {full}",
            f"KV cache {tokens} tokens = {tokens // full} requests of the full {full} tokens "
            f"({layout})",
            f"ready on {url}"]


def _mixed_graphs(engine: Any) -> int:
    """How many captured graphs of the mixed step a paged engine's launched steps replay (0: none, as on the CPU)."""
    graphs = getattr(engine.paged, "mixed_graphs", None)
    return len(graphs.graphs) if graphs is not None and getattr(engine, "captured_mixed", False) else 0


def _text_side(session: Any) -> Any:
    """generate.py's tokenizer, chat template, EOS ids and incremental detokenizer for this model."""
    from trtbuild.serving.generate import text_side

    return text_side(session)


def _warm_paged(engine: Any) -> None:
    """The paged graph's first calls: a one-token prompt and a decode step in block 0 (a free block, whose
    contents no request reads before writing them); then, on CUDA, every row-count bucket's graph captured, so
    that no request's step pays a capture."""
    from trtbuild.backends.sampling import Sampling

    engine.prefill_paged([-1], [[0]], [[0]], [0], [Sampling()], [True])
    engine.decode_paged([-1], [[0]], [0], [1], [Sampling(temperature=1.0, top_p=0.9, seed=0)])
    if getattr(engine, "can_mix", False):  # the mixed step's first call: a decode row and a chunk, both in block 0
        engine.step_paged(([-1], [[0]], [0], [2], [Sampling()]), ([-2], [[0]], [[0]], [3], [Sampling()], [True]))
        engine.release(-2)
    if getattr(engine, "can_overlap", False):  # a launched step, then one fed from it (Scheduler._launch)
        engine.launch_paged(([-1], [[0]], [0], [4], [Sampling()]), None, []).result()
        engine.launch_paged(([-1], [[0]], [0], [5], [Sampling()]), None, [(0, 0)]).result()
    engine.release(-1)
    capture = getattr(engine, "capture_paged", None)
    if callable(capture):
        capture()


def _warm(engine: Any, buckets: list[int]) -> None:
    """Every decode bucket's first calls (graph capture on a GPU) and the sampling path, before /health is
    ready: each bucket's rows prefilled with one token, decoded twice, released."""
    from trtbuild.backends.sampling import Sampling

    plans = [Sampling(), Sampling(temperature=1.0, top_p=0.9, seed=0)]
    capture = getattr(engine, "capture_all", None)  # the torch backend: every cache window's graph, now
    if callable(capture):
        capture()
    # and every prompt length's prefill graph: a request that met a length first paid its capture, and the
    # gate's serve row (16 streams of 256-1024-token prompts) saw those requests in its TTFT p99
    capture_prefill = getattr(engine, "capture_prefill", None)
    if callable(capture_prefill):
        capture_prefill()
    for b in buckets:
        slots = list(range(b))
        tokens = [engine.prefill(s, [0], plans[0]) for s in slots]
        for step in range(2):
            tokens = engine.decode(slots, tokens, [1 + step] * b, [plans[step % 2]] * b)
        for s in slots:
            engine.release(s)


# -- the HTTP app -------------------------------------------------------------------------------------------------
def create_app(server: Server) -> Any:
    """The FastAPI app over `server` (its engine thread started by the app's lifespan)."""
    import contextlib

    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from trtbuild.serving.metrics import CONTENT_TYPE

    Completion, Chat = request_models()

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        server.start()
        yield
        # uvicorn has stopped taking connections and waited for the open ones: now the engine thread ends
        await asyncio.to_thread(server.drain, 60.0)

    app = FastAPI(title="trtbuild", lifespan=lifespan)

    def rejected(exc: ApiError) -> JSONResponse:
        # every refusal passes here, so /metrics counts each by its reason (a 500 is a failure, counted as one)
        if exc.status != 500:
            server.metrics.rejected.labels(exc.reason).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        return rejected(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return rejected(ApiError(400, str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own answers (no such path, a method the path does not take) in OpenAI's error object too
        what = {404: f"no such endpoint: {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return rejected(ApiError(exc.status_code, what, param=None, code=code, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def internal_error(request: HttpRequest, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = server.status == "ready"
        body = {"status": server.status} | ({"error": server.failure} if server.failure else {})
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": server.name, "object": "model", "created": server.created, "owned_by": "trtbuild"}
        if server.scheduler is not None:
            card["max_model_len"] = server.scheduler.engine.max_seq_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Any:
        params = parse(await request.body(), Completion)
        server.check_ready(params)
        prompts = _completion_prompts(server, params.prompt)
        return await _generate(request, params, prompts, params.max_tokens, 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest) -> Any:
        params = parse(await request.body(), Chat)
        server.check_ready(params)
        messages = [flat_message(m.model_dump(exclude_none=True)) for m in params.messages]
        try:
            prompt = server.text.chat(messages)
        except InputError as exc:
            raise ApiError(400, exc.message, param="messages") from None
        limit = params.max_completion_tokens if params.max_completion_tokens is not None else params.max_tokens
        return await _generate(request, params, [prompt], limit, None, chat=True)

    async def _generate(request: HttpRequest, params: Any, prompts: list[list[int]], max_tokens: int | None,
                        default_max: int | None, chat: bool) -> Any:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def emit(index: int, event: Event) -> None:  # the engine thread, during a step
            server.outbox.put(loop, events, (index, event))

        reqs = server.requests(prompts, params, max_tokens, default_max, emit)
        server.submit(reqs)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        usage = {"prompt_tokens": sum(len(r.prompt) for r in reqs[::params.n])}
        # token ids in the choices: asked for, or the only output of a model without a tokenizer
        ids = params.return_token_ids or not server.text.can_detokenize
        if params.stream:
            include_usage = bool((params.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(reqs, events, rid, chat, usage, include_usage, ids),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(request, reqs, events, rid, chat, usage, ids)

    async def _stream(reqs: list[Request], events: asyncio.Queue[tuple[int, Event]], rid: str, chat: bool,
                      usage: dict[str, int], include_usage: bool, ids: bool) -> AsyncIterator[str]:
        left = len(reqs)
        try:
            if chat:
                for i in range(len(reqs)):
                    yield sse(chunk(rid, server.name, chat, i, None, None, role=True))
            failed = False
            while left and not failed:
                # every event that has come since this stream last ran, in one write: a stream of an event loop
                # that has fallen behind the engine catches up in fewer sends
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                out = []
                for index, ev in batch:
                    if ev.finish == "error":
                        out.append(sse(ApiError(500, ev.error or "generation failed", "server_error").body()))
                        failed = True
                        break
                    if ev.text or ev.finish or (ids and ev.token is not None):
                        token_ids = ([] if ev.token is None else [ev.token]) if ids else None
                        text = ev.text if ev.text or ids else None
                        out.append(sse(chunk(rid, server.name, chat, index, text, finish_reason(ev.finish),
                                             token_ids=token_ids)))
                    if ev.finish:
                        left -= 1
                if out:
                    yield "".join(out)
            if include_usage and not left:
                yield sse(usage_chunk(rid, server.name, chat, usage, sum(r.generated for r in reqs)))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (a cancelled task), or an error: free every row at the next step
            for r in reqs:
                if not r.done:
                    server.scheduler.cancel(r)  # type: ignore[union-attr]

    async def _collect(request: HttpRequest, reqs: list[Request], events: asyncio.Queue[tuple[int, Event]],
                       rid: str, chat: bool, usage: dict[str, int], ids: bool) -> Any:
        texts = [""] * len(reqs)
        tokens: list[list[int]] = [[] for _ in reqs]
        finishes: list[str | None] = [None] * len(reqs)
        left = len(reqs)
        try:
            while left:
                try:
                    index, ev = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():  # nobody to answer: give the rows back
                        return Response(status_code=499)
                    continue
                texts[index] += ev.text
                if ev.token is not None:
                    tokens[index].append(ev.token)
                if ev.finish:
                    if ev.finish == "error":
                        raise ApiError(500, ev.error or "generation failed", "server_error")
                    finishes[index] = ev.finish
                    left -= 1
        finally:
            for r in reqs:
                if not r.done:
                    server.scheduler.cancel(r)  # type: ignore[union-attr]
        return response(rid, server.name, chat, texts, finishes, tokens if ids else None, usage,
                        sum(r.generated for r in reqs))

    return app


def _completion_prompts(server: Server, prompt: Any) -> list[list[int]]:
    """A completion's `prompt` as token ids: a string, a list of strings, a list of ids, a list of id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        raise ApiError(400, "prompt: empty", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not server.text.can_encode:
                raise ApiError(400, "prompt: text needs the model's tokenizer, which this engine lacks; send token "
                               "ids", param="prompt")
            out.append(server.text.encode(p))
        else:
            out.append(list(p))
    return out


# -- the process ------------------------------------------------------------------------------------------------
def serve(session: Any, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 256,
          log_level: str = "info", kv: KvSettings | None = None, switch_interval: float | None = None) -> int:
    """Serve `session` (a runner.Session, not yet entered) until SIGTERM or Ctrl-C; the exit status.
    `switch_interval`: Python's GIL switch interval while serving (None: SWITCH_INTERVAL_S)."""
    require()
    import uvicorn

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if server.status == "ready":  # /health says so at once; open streams run to their end
                server.status = "draining"
            super().handle_exit(sig, frame)

    def failed() -> None:
        web.should_exit = True

    def announce(line: str) -> None:
        if log_level != "warning":  # -q: nothing but warnings
            print(line, file=sys.stderr, flush=True)

    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # where a local client reaches it
    server = Server(session, max_queue=max_queue, on_fail=failed, url=f"http://{shown}:{port}/v1",
                    announce=announce, kv=kv)
    config = uvicorn.Config(create_app(server), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=None, lifespan="on")
    web = _Uvicorn(config)
    # uvicorn raises the signal it caught again once it has shut down, which would end a drained server by
    # that signal; the re-raise meets these handlers instead, so a drained exit is a clean one (status 0).
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    interval = sys.getswitchinterval()
    if switch_interval is None:  # TRTBUILD_SWITCH_INTERVAL_MS: a diagnostic switch (docs/diagnostics.md)
        ms = os.environ.get("TRTBUILD_SWITCH_INTERVAL_MS")
        switch_interval = float(ms) / 1e3 if ms else SWITCH_INTERVAL_S
    sys.setswitchinterval(switch_interval)
    try:
        web.run()
    finally:
        sys.setswitchinterval(interval)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if server.status == "failed":
        raise TrtbuildError(f"the engine could not be served: {server.failure}")
    return 0
