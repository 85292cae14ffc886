"""Continuous batching over an engine's slots: the loop between the HTTP server and the device.

A bounded queue of waiting requests; at each step boundary the scheduler drops what was cancelled,
admits waiting requests into free cache rows (the lowest rows first, so the running rows stay in the
smallest batch bucket), prefills each newcomer, then runs one decode step for every running row, each
at its own position. A request that ends (a stop token, a stop string, its token budget, a cancel or a
disconnect) gives its row back at once. The engine runs in one thread of its own; callers, usually an
asyncio loop, hear of tokens through a callback that must not block.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from trtbuild.errors import InputError, TrtbuildError
from trtbuild.serving.paged_steps import PagedSteps, _Launch
from trtbuild.serving.request import Event, Request, TextWatch

__all__ = ["Event", "QueueFull", "Request", "Scheduler", "ShuttingDown", "TextWatch", "check_request"]

log = logging.getLogger(__name__)


class SlotEngine(Protocol):
    """The part of a loaded engine the scheduler drives (trtbuild.backends.Engine's slot API)."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    vocab_size: int

    def prefill(self, slot: int, prompt: list[int], sampling: Any) -> int: ...

    def decode(self, slots: list[int], tokens: list[int], positions: list[int], sampling: list[Any]) -> list[int]: ...

    def release(self, slot: int) -> None: ...


class PagedEngine(SlotEngine, Protocol):
    """An engine reading its KV cache through block tables (kv_blocks.py): any prompt chunk from any start
    position, and decode steps of any rows; `key` names a request's sampling history (release(key) ends it)."""

    def prefill_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[list[int]], starts: list[int],
                      sampling: list[Any], lasts: list[bool]) -> list[int | None]:
        """Prompt chunks of several requests in one call; the token after each chunk whose `lasts` entry is
        true (None for the others: their tokens are not wanted, and nothing waits for them)."""
        ...

    def decode_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[int], positions: list[int],
                     sampling: list[Any]) -> list[int]: ...


class Observer(Protocol):
    """Where the scheduler reports what metrics need (server.py's Prometheus collectors); every method cheap."""

    def queued(self, waiting: int, running: int) -> None: ...

    def first_token(self, seconds: float, prompt_tokens: int) -> None: ...

    def token_interval(self, seconds: float) -> None: ...

    def step(self, rows: int, bucket: int, seconds: float, context_tokens: int) -> None: ...

    def finished(self, reason: str, generated: int) -> None: ...

    def blocks(self, used: int, free: int, hits: int, misses: int) -> None: ...

    def preempted(self) -> None: ...

    def device_busy(self, seconds: float) -> None:
        """A launched step's time on the device, from its stream reaching it to its last kernel's end."""


class _Quiet:
    def queued(self, waiting: int, running: int) -> None: pass

    def first_token(self, seconds: float, prompt_tokens: int) -> None: pass

    def token_interval(self, seconds: float) -> None: pass

    def step(self, rows: int, bucket: int, seconds: float, context_tokens: int) -> None: pass

    def finished(self, reason: str, generated: int) -> None: pass

    def blocks(self, used: int, free: int, hits: int, misses: int) -> None: pass

    def preempted(self) -> None: pass

    def device_busy(self, seconds: float) -> None: pass


class QueueFull(TrtbuildError):
    """The waiting queue is at its bound; `retry_after_s` is a guess at when a place frees up."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        super().__init__(f"the server's queue is full ({limit} waiting requests)", hint="retry later")
        self.retry_after_s = retry_after_s


class ShuttingDown(TrtbuildError):
    """The scheduler is draining for exit and takes no new requests."""


def check_request(engine: SlotEngine, prompt: list[int], max_tokens: int) -> None:
    """Raise InputError naming the engine limit this request exceeds; a request is never truncated."""
    n = len(prompt)
    if n == 0:
        raise InputError("prompt: empty; at least one token is needed")
    if n > engine.max_input_len:
        raise InputError(f"prompt: {n} tokens, more than the engine's max_input_len of {engine.max_input_len}")
    if max_tokens < 1:
        raise InputError(f"max_tokens: must be >= 1, got {max_tokens}")
    if n + max_tokens > engine.max_seq_len:
        raise InputError(f"max_tokens: the prompt's {n} tokens plus {max_tokens} new ones exceed the engine's "
                         f"max_seq_len of {engine.max_seq_len} (at most {max(engine.max_seq_len - n, 0)} new tokens)")
    bad = next((t for t in prompt if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise InputError(f"prompt: token id {bad} is outside the vocabulary [0, {engine.vocab_size})")


class Scheduler(PagedSteps):
    """Continuous batching over `engine`'s rows. `start()` runs the loop in its own thread; tests may call
    `step()` directly instead. `buckets` are the engine's decode batch sizes (for occupancy figures).

    With a `pool` (kv_blocks.BlockPool) the engine is a PagedEngine: a request is admitted when the pool has
    blocks for its prompt (its cached prefix counted), prompts are prefilled in chunks of at most
    `chunk_tokens` a step beside the decode rows (so a running stream waits at most one chunk a token), and a
    decode row that needs a block when none is free preempts the latest admitted request, which goes back to
    the head of the queue and is prefilled again (recomputed) when blocks free up."""

    def __init__(self, engine: SlotEngine, max_queue: int = 256, buckets: list[int] | None = None,
                 observer: Observer | None = None, pool: Any = None, chunk_tokens: int | None = None,
                 flush: Callable[[], None] = lambda: None, mixed: bool = True, overlap: bool = True,
                 prefill_order: str = "shortest") -> None:
        self.engine = engine
        # paged: which prompts' chunks a step takes first (PagedSteps._prefilling): "shortest", the fewest prompt
        # tokens left first, or "arrival", admission order
        if prefill_order not in ("arrival", "shortest"):
            raise ValueError(f"prefill_order must be 'arrival' or 'shortest', got {prefill_order!r}")
        self.prefill_order = prefill_order
        # paged: a step's decode rows and prompt chunks in one call, where the engine has the mixed step
        self.mixed = mixed and bool(getattr(engine, "can_mix", False))
        # paged: each step launched before the step before is read back, so that the host's work on a step's
        # tokens (delivering them, the next step's inputs) runs while the device computes the next step
        self.overlap = overlap and bool(getattr(engine, "can_overlap", False))
        self._inflight: _Launch | None = None
        self._serial = 0
        # Hands the events emitted so far to whoever reads them (a server's Outbox): called after every step of
        # run(), and at once after a newcomer's first token, which must not wait for the other newcomers'
        # prefills and the decode step (an H100 gate run measured TTFT p50 +9% and 5% fewer tokens a second at
        # 16 streams on 8 rows when first tokens waited for the step's end)
        self.flush = flush
        self.max_queue = max_queue
        self.buckets = sorted(buckets or [engine.max_batch_size])
        self.observer: Observer = observer or _Quiet()
        self.pool = pool
        self.rows = self.buckets[-1] if pool is not None else engine.max_batch_size  # rows a decode step holds
        # a chunk is one call of the engine's prompt graph, which takes at most max_input_len tokens
        self.chunk_tokens = min(chunk_tokens or engine.max_input_len, engine.max_input_len)
        # paged: the (rows, tokens a row) shapes of the engine's captured chunk graphs, where its steps replay them
        # (serve --captured-chunks): chunks are then planned to those shapes (PagedSteps._plan_bucketed)
        self.chunk_buckets: list[tuple[int, int]] = sorted(getattr(engine, "chunk_buckets", None) or [])
        # the budget such a step's chunks are planned in, and the buckets' tokens a row within it (none: chunks are
        # planned without the shapes, as a budget below every bucket's tokens leaves them)
        self.chunk_budget = min(self.chunk_tokens, max((t for _, t in self.chunk_buckets), default=0))
        self.chunk_widths = sorted({t for _, t in self.chunk_buckets if t <= self.chunk_budget})
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in admission order
        self._free: list[int] = list(range(engine.max_batch_size))  # a heap: the lowest row first
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # no new requests (draining)
        self.step_s = 0.05  # a running estimate of one step, for Retry-After

    # -- the caller's side (any thread) -----------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue a request, or raise InputError (does not fit the engine), QueueFull or ShuttingDown."""
        self.submit_all([request])
        return request

    def submit_all(self, requests: list[Request]) -> None:
        """Queue all of them or none (the `n` choices of one HTTP request): InputError, QueueFull, ShuttingDown."""
        for r in requests:
            check_request(self.engine, r.prompt, r.max_tokens)
        with self._wake:
            if self._closed:
                raise ShuttingDown("the server is shutting down", hint="retry on another replica")
            # The bound counts only the requests that cannot be admitted at the next step boundary: with free
            # rows (and blocks) a burst is admitted, not refused while rows sit idle.
            if self._blocked(requests) > self.max_queue:
                # one place frees when a running row ends; a step per token of the shortest remaining budget
                raise QueueFull(self.max_queue, max(1.0, self.step_s * self._soonest_end()))
            now = time.perf_counter()
            for r in requests:
                r.arrived = now
                self._waiting.append(r)
            self.observer.queued(len(self._waiting), len(self._running))
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """End a request (a client gone, a stop string seen by the caller); its row frees at the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def bucket_for(self, rows: int) -> int:
        """The smallest decode bucket that holds `rows` running rows."""
        return next(b for b in self.buckets if b >= rows)

    # -- the engine thread --------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the loop in a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="trtbuild-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; with `drain`, let the queued and running ones finish first, else cancel them."""
        with self._wake:
            self._closed = True
            if not drain:
                for r in [*self._waiting, *self._running]:
                    r.cancelled = True
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        """The loop, in the calling thread (the one that loaded the engine): steps while there is work,
        sleeps while there is none, returns once `stop` is called and nothing is left."""
        while True:
            with self._wake:
                while not (self._waiting or self._running) and not self._stopping:
                    self._wake.wait()
                if self._stopping and not (self._waiting or self._running):
                    return
            try:
                self.step()
            except Exception as exc:  # a bug here must end the requests it touched, never the server
                log.exception("scheduler step failed")
                self._inflight = None
                for r in list(self._running):
                    self._finish(r, "error", f"{type(exc).__name__}: {exc}", flushed=True)
            finally:
                self.flush()

    def step(self) -> bool:
        """One step boundary: free cancelled rows, admit and prefill newcomers, decode every running row.
        Returns whether there was anything to do."""
        for r in [r for r in self._running if r.cancelled]:  # first: their rows go to the newcomers
            self._finish(r, "cancelled")
        with self._wake:
            for r in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(r)
                self._finish(r, "cancelled")
            if self.pool is not None:
                newcomers = self._admit_paged()
            else:
                newcomers = []
                while self._waiting and len(newcomers) < len(self._free):
                    newcomers.append(self._waiting.popleft())
        if self.pool is not None:
            return self._paged_step(newcomers)
        for r in newcomers:
            self._prefill(r)
        worked = bool(newcomers or self._running)  # before the decode, which may end every running row
        if self._running:
            self._decode()
        self.observer.queued(len(self._waiting), len(self._running))
        return worked

    # -- rows ----------------------------------------------------------------------------------------------
    def _prefill(self, r: Request) -> None:
        r.slot = heapq.heappop(self._free)
        self._running.append(r)
        try:
            token = self.engine.prefill(r.slot, r.prompt, r.sampling)
        except Exception as exc:  # one bad request must not take the server down
            self._finish(r, "error", f"prefill failed: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        self.observer.first_token(now - r.arrived, len(r.prompt))
        r.position, r.last_time = len(r.prompt), now
        self._accept(r, token)
        self.flush()

    def _decode(self) -> None:
        rows = list(self._running)
        t = time.perf_counter()
        try:
            tokens = self.engine.decode([r.slot for r in rows], [r.last_token for r in rows],  # type: ignore[misc]
                                        [r.position for r in rows], [r.sampling for r in rows])
        except Exception as exc:
            for r in rows:
                self._finish(r, "error", f"decode failed: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        self.step_s = 0.9 * self.step_s + 0.1 * (now - t)
        self.observer.step(len(rows), self.bucket_for(len(rows)), now - t, sum(r.position + 1 for r in rows))
        for r, token in zip(rows, tokens):
            self.observer.token_interval(now - r.last_time)
            r.last_time = now
            r.position += 1
            self._accept(r, token)

    def _accept(self, r: Request, token: int) -> None:
        try:
            self._deliver(r, token)
        except Exception as exc:  # a tokenizer's or a callback's failure ends this request, not the loop
            self._finish(r, "error", f"{type(exc).__name__}: {exc}", flushed=True)

    def _deliver(self, r: Request, token: int) -> None:
        """Deliver a generated token, or end the request on it."""
        if token in r.stop_ids:
            self._finish(r, "stop")
            return
        r.generated += 1
        r.last_token = token
        r.history.append(token)
        text, stopped = r.watch.feed(token) if r.watch is not None else ("", False)
        if stopped:
            if text:
                r.on_event(Event(None, text))
            self._finish(r, "stop", flushed=True)
        elif r.generated >= r.max_tokens:
            r.on_event(Event(token, text))
            self._finish(r, "length")
        else:
            r.on_event(Event(token, text))

    def _finish(self, r: Request, reason: str, error: str | None = None, flushed: bool = False) -> None:
        if r.done:
            return
        r.done = True
        if r.slot is not None:
            self._running.remove(r)
            self.engine.release(r.slot)
            heapq.heappush(self._free, r.slot)
            r.slot = None
        elif r.table is not None:
            self._running.remove(r)
            self.pool.release(r.table)
            self.engine.release(r.id)
            r.table = None
        self.observer.finished(reason, r.generated)
        try:
            tail = r.watch.flush() if r.watch is not None and not flushed and reason != "error" else ""
            r.on_event(Event(None, tail, finish=reason, error=error))
        except Exception as exc:
            if reason != "error":  # the caller still hears that its request ended
                r.on_event(Event(None, "", finish="error", error=f"{type(exc).__name__}: {exc}"))

    def _blocked(self, extra: list[Request]) -> int:
        """How many of the waiting requests, and `extra` more, the next step boundary could not admit."""
        queue = [*self._waiting, *extra]
        if self.pool is None:
            return max(0, len(queue) - len(self._free))
        rows, free, admitted = self.rows - len(self._running), self.pool.free, 0
        for r in queue:  # in order, as admission goes (the prefix cache left out: an upper bound)
            need = self.pool.blocks_for(r.sequence_len())
            if admitted >= rows or need > free:
                break
            free, admitted = free - need, admitted + 1
        return len(queue) - admitted

    def _soonest_end(self) -> int:
        return min((r.max_tokens - r.generated for r in list(self._running)), default=1)
