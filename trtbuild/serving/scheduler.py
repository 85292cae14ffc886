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
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from trtbuild.errors import InputError, TrtbuildError

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


class TextWatch(Protocol):
    """Per request: turns tokens into text that is safe to emit (no half characters) and spots stop strings."""

    def feed(self, token: int) -> tuple[str, bool]:
        """The text that became final with this token, and whether a stop string has now appeared (the text
        then ends before it)."""
        ...

    def flush(self) -> str:
        """What was held back, emitted once the request ends by anything but a stop string."""
        ...


class Observer(Protocol):
    """Where the scheduler reports what metrics need (server.py's Prometheus collectors); every method cheap."""

    def queued(self, waiting: int, running: int) -> None: ...

    def first_token(self, seconds: float, prompt_tokens: int) -> None: ...

    def token_interval(self, seconds: float) -> None: ...

    def step(self, rows: int, bucket: int, seconds: float, context_tokens: int) -> None: ...

    def finished(self, reason: str, generated: int) -> None: ...

    def blocks(self, used: int, free: int, hits: int, misses: int) -> None: ...

    def preempted(self) -> None: ...


class _Quiet:
    def queued(self, waiting: int, running: int) -> None: pass

    def first_token(self, seconds: float, prompt_tokens: int) -> None: pass

    def token_interval(self, seconds: float) -> None: pass

    def step(self, rows: int, bucket: int, seconds: float, context_tokens: int) -> None: pass

    def finished(self, reason: str, generated: int) -> None: pass

    def blocks(self, used: int, free: int, hits: int, misses: int) -> None: pass

    def preempted(self) -> None: pass


class QueueFull(TrtbuildError):
    """The waiting queue is at its bound; `retry_after_s` is a guess at when a place frees up."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        super().__init__(f"the server's queue is full ({limit} waiting requests)", hint="retry later")
        self.retry_after_s = retry_after_s


class ShuttingDown(TrtbuildError):
    """The scheduler is draining for exit and takes no new requests."""


@dataclass(frozen=True)
class Event:
    """What a request's callback receives: one generated token (with the text it made final), or the end.

    `finish` is None while the request runs, else "stop" (a stop token or string), "length" (max_tokens),
    "cancelled" or "error" (`error` says what). A stop token itself is never delivered (`token` None)."""

    token: int | None
    text: str = ""
    finish: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Request:
    """One generation: the prompt's token ids, how to sample, when to stop, and where its events go. Compared by
    identity (the scheduler's lists find and remove requests at every step: a field-by-field comparison made
    that the step's largest cost at 256 rows)."""

    prompt: list[int]
    max_tokens: int
    sampling: Any = None  # trtbuild.backends.sampling.Sampling; None means the engine's default (greedy)
    stop_ids: frozenset[int] = frozenset()  # EOS ids and the request's stop token ids
    watch: TextWatch | None = None  # text and stop strings; None: tokens only
    on_event: Callable[[Event], None] = lambda event: None  # called from the engine thread: must not block
    id: int = field(default_factory=itertools.count().__next__)
    # filled in by the scheduler
    arrived: float = 0.0
    generated: int = 0
    slot: int | None = None
    position: int = 0  # the position of the token fed at the next decode step
    last_token: int = 0
    last_time: float = 0.0
    cancelled: bool = False
    done: bool = False
    # paged (kv_blocks.py): the request's blocks, and how many tokens of its sequence their KV holds
    table: Any = None
    filled: int = 0
    history: list[int] = field(default_factory=list)  # the generated tokens delivered, for a recompute
    # (launch serial, row) of the token a launched step computes for it and the host has not read back yet
    pending: tuple[int, int] | None = None

    def sequence(self) -> list[int]:
        """The tokens whose KV the request needs before its next decode step: the prompt, and after a
        preemption everything generated but the last token (which the next step feeds)."""
        return self.prompt + self.history[:-1] if self.history else self.prompt

    def sequence_len(self) -> int:
        """len(sequence()), without building it."""
        return len(self.prompt) + max(0, len(self.history) - 1)


@dataclass(eq=False)
class _Launch:
    """A paged step launched on the device and not yet read back (Scheduler._launch)."""

    handle: Any  # the engine's launched step: .result() -> (decode rows' tokens, chunks' tokens or None)
    serial: int
    rows: list[Request]
    plan: list[tuple[Request, int]]
    lasts: list[bool]
    t: float
    context: int  # the decode rows' context tokens, for the observer


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


class Scheduler:
    """Continuous batching over `engine`'s rows. `start()` runs the loop in its own thread; tests may call
    `step()` directly instead. `buckets` are the engine's decode batch sizes (for occupancy figures).

    With a `pool` (kv_blocks.BlockPool) the engine is a PagedEngine: a request is admitted when the pool has
    blocks for its prompt (its cached prefix counted), prompts are prefilled in chunks of at most
    `chunk_tokens` a step beside the decode rows (so a running stream waits at most one chunk a token), and a
    decode row that needs a block when none is free preempts the latest admitted request, which goes back to
    the head of the queue and is prefilled again (recomputed) when blocks free up."""

    def __init__(self, engine: SlotEngine, max_queue: int = 256, buckets: list[int] | None = None,
                 observer: Observer | None = None, pool: Any = None, chunk_tokens: int | None = None,
                 flush: Callable[[], None] = lambda: None, mixed: bool = True, overlap: bool = True) -> None:
        self.engine = engine
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

    # -- paged -----------------------------------------------------------------------------------------------
    def _admit_paged(self) -> list[Request]:
        """Waiting requests, in order, while a row and the pool's blocks allow (the lock is held). The head
        waits for blocks rather than being overtaken, so a long prompt is never starved by short ones."""
        out: list[Request] = []
        while self._waiting and len(self._running) + len(out) < self.rows:
            r = self._waiting[0]
            table = self.pool.admit(r.sequence())
            if table is None:
                break
            self._waiting.popleft()
            r.table, r.filled = table, table.cached
            out.append(r)
        return out

    def _paged_step(self, newcomers: list[Request]) -> bool:
        self._running.extend(newcomers)
        worked = bool(newcomers or self._running)
        if not (self.overlap and self._launch()):
            self._drain()  # the steps below wait for their own tokens: the launched one is read back first
            self._step_in_turn()
        p = self.pool
        self.observer.blocks(p.used, p.free, p.hits, p.misses)
        self.observer.queued(len(self._waiting), len(self._running))
        return worked

    def _step_in_turn(self) -> None:
        """A step whose calls return their tokens: the chunks and the decode rows in one call (the mixed step)
        or two."""
        plan = self._plan_chunks()
        mixed = False
        if plan and self.mixed:
            # the rows decoding now and this step's chunks in one call: the step reads each weight once (a prompt
            # that ends in it decodes from the next step)
            rows = self._make_room(self._due())
            plan = [(r, n) for r, n in plan if r.table is not None]  # not preempted for the rows' blocks
            mixed = bool(rows and plan) and self._mixed(plan, rows)
        if not mixed:  # the chunks, then every row (a prompt that ends in them too)
            if plan:
                self._prefill_chunks(plan)
            rows = self._make_room(self._due())
            if rows:
                self._decode_paged(rows)

    def _due(self) -> list[Request]:
        """The running requests whose next token a decode step gives: its token to feed is known or launched,
        and every position before it is written."""
        return [r for r in self._running if (r.history or r.pending is not None) and r.filled >= r.position]

    def _launch(self) -> bool:
        """Launch this step's decode rows (and its chunks, in the mixed step) without waiting for their tokens,
        then read back and deliver the step launched before, while the device runs this one. A row's token from
        that step is fed to this one on the device. So a row that ends on that token (a stop token or string)
        has computed one token more, which is dropped; a row whose budget that token ends is not launched.
        False, with nothing launched, where this step must wait for its tokens instead: no decode row, chunks
        without the mixed step, a sampled row (its penalties need its tokens on the host), too few free blocks
        for every row's next one (a preemption), or an engine call that declines or fails."""
        plan = self._plan_chunks()
        rows = [r for r in self._due() if r.generated + (r.pending is not None) < r.max_tokens]
        if not rows or (plan and not self.mixed) or self.pool.free < len(rows):
            return False
        if not all(r.sampling is None or r.sampling.greedy for r in [*rows, *(r for r, _ in plan)]):
            return False
        rows = self._make_room(rows)  # a block a row at most, and as many free: nothing is preempted
        serial = self._serial + 1
        fed = [(i, r.pending[1]) for i, r in enumerate(rows) if r.pending is not None]
        args = self._chunk_args(plan) if plan else None
        t = time.perf_counter()
        try:
            handle = self.engine.launch_paged(self._decode_args(rows), args, fed)  # type: ignore[attr-defined]
        except Exception:
            log.exception("launching a step failed; it goes again, waited for")
            return False
        if handle is None:
            return False
        self._serial = serial
        lasts = args[-1] if args else []
        launch = _Launch(handle, serial, rows, plan, lasts, t, sum(r.position + 1 for r in rows))
        for i, r in enumerate(rows):
            r.position += 1
            r.filled, r.pending = r.position, (serial, i)
        for j, ((r, n), last) in enumerate(zip(plan, lasts)):
            r.filled += n
            self.pool.name_full_blocks(r.table, r.sequence()[:r.filled])
            if last:
                r.position, r.pending = len(r.prompt), (serial, len(rows) + j)
        before, self._inflight = self._inflight, launch
        if before is not None:
            self._resolve(before)
        return True

    def _drain(self) -> None:
        """Read back and deliver the launched step, if one is."""
        if self._inflight is not None:
            done, self._inflight = self._inflight, None
            self._resolve(done)

    def _resolve(self, done: _Launch) -> None:
        """Deliver a launched step's tokens (waiting for them): the first tokens of the prompts it ended, then
        the decode rows'. A request that ended since it was launched (a cancel, or a stop on the step before's
        token) has its token dropped."""
        try:
            decoded, firsts = done.handle.result()
        except Exception as exc:
            for r in [*done.rows, *(r for r, _ in done.plan)]:
                r.pending = None
                self._finish(r, "error", f"decode failed: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        self.step_s = 0.9 * self.step_s + 0.1 * (now - done.t)
        self.observer.step(len(done.rows), self.bucket_for(len(done.rows)), now - done.t, done.context)
        block = self.pool.block_size
        for (r, _), last, token in zip(done.plan, done.lasts, firsts):
            if r.pending is not None and r.pending[0] == done.serial:
                r.pending = None
            if last and not r.done:
                self.observer.first_token(now - r.arrived, len(r.prompt))
                r.last_time = now
                self._accept(r, token)  # type: ignore[arg-type]
        for r, token in zip(done.rows, decoded):
            if r.pending is not None and r.pending[0] == done.serial:
                r.pending = None
            if r.done:
                continue
            self.observer.token_interval(now - r.last_time)
            r.last_time = now
            if (len(r.prompt) + len(r.history)) // block > r.table.named:  # the KV through the fed token is written
                self.pool.name_full_blocks(r.table, r.prompt + r.history)
            self._accept(r, token)

    def _plan_chunks(self) -> list[tuple[Request, int]]:
        """This step's prompt chunks, (request, tokens), in admission order. A step's chunks go in one call as rows
        left-padded to the longest, so the budget counts what the call computes, padding included: k rows of at
        most `chunk_tokens / k` tokens each, and a row is not added where the rows before it are already longer
        than that. Eight 64-token questions after a cached prefix still go together in a 512-token budget;
        a 500-token chunk and six 2-token prompts no longer make a call of 7 x 500 tokens."""
        budget, longest = self.chunk_tokens, 0
        plan: list[tuple[Request, int]] = []
        for r in self._running:
            rest = r.sequence_len() - r.filled
            if rest <= 0:
                continue
            k = len(plan) + 1
            n = min(rest, budget // k)
            if n <= 0 or k * max(longest, n) > budget:
                break
            plan.append((r, n))
            longest = max(longest, n)
        return plan

    def _prefill_chunks(self, plan: list[tuple[Request, int]]) -> None:
        """Prefill each planned chunk (the next `n` tokens of r's sequence), all in one engine call: one launch
        of the paged graph however many requests start this step. Where that call fails, each chunk is tried
        alone, so that a bad request ends by itself."""
        args = self._chunk_args(plan)
        try:
            tokens = self.engine.prefill_paged(*args)  # type: ignore[attr-defined]
        except Exception as exc:
            if len(plan) > 1:
                for item in plan:
                    self._prefill_chunks([item])
                return
            self._finish(plan[0][0], "error", f"prefill failed: {type(exc).__name__}: {exc}")
            return
        self._chunks_done(plan, args[-1], tokens)

    def _chunk_args(self, plan: list[tuple[Request, int]]) -> tuple[Any, ...]:
        """`prefill_paged`'s arguments for the planned chunks: keys, tables, chunks, starts, samplings, lasts."""
        seqs = [r.sequence() for r, _ in plan]
        # a chunk's token is wanted only where it ends the prompt: no other makes the host wait for the device
        lasts = [r.filled + n == len(seq) and not r.history for (r, n), seq in zip(plan, seqs)]
        return ([r.id for r, _ in plan], [r.table.blocks for r, _ in plan],
                [seq[r.filled:r.filled + n] for (r, n), seq in zip(plan, seqs)], [r.filled for r, _ in plan],
                [r.sampling for r, _ in plan], lasts)

    def _chunks_done(self, plan: list[tuple[Request, int]], lasts: list[bool], tokens: list[int | None]) -> None:
        for (r, n), last, token in zip(plan, lasts, tokens):
            r.filled += n
            self.pool.name_full_blocks(r.table, r.sequence()[:r.filled])
            if last:  # the prompt's last chunk: the first token, handed over at once
                now = time.perf_counter()
                self.observer.first_token(now - r.arrived, len(r.prompt))
                r.position, r.last_time = len(r.prompt), now
                self._accept(r, token)
        if any(lasts):
            self.flush()
        # after a preemption the recomputed sequence's token was delivered before: the next step feeds last_token

    def _make_room(self, rows: list[Request]) -> list[Request]:
        """Blocks for every decode row's next position; where the pool has none, the latest admitted request
        is preempted (its blocks freed, recomputed later) until the rest fit. The rows that still decode."""
        kept: list[Request] = []
        gone: set[int] = set()  # ids of the rows preempted here
        for r in rows:
            if r.id in gone:
                continue
            while not self.pool.grow(r.table, r.position + 1):
                victim = self._running[-1]
                if victim is r and len(self._running) == 1:  # cannot happen with a pool of one full sequence
                    self._finish(r, "error", "the KV pool cannot hold one sequence of the engine's length")
                    gone.add(r.id)
                    break
                self._preempt(victim)
                gone.add(victim.id)
                if victim is r:
                    break
            else:
                kept.append(r)
        return [r for r in kept if r.id not in gone]

    def _preempt(self, r: Request) -> None:
        self._running.remove(r)
        self.pool.release(r.table)
        self.engine.release(r.id)
        r.table, r.filled = None, 0
        with self._wake:
            self._waiting.appendleft(r)
        self.observer.preempted()

    def _mixed(self, plan: list[tuple[Request, int]], rows: list[Request]) -> bool:
        """The decode rows and the planned chunks in one engine call; False, with nothing done, where the engine
        cannot take them together or the call fails (the caller makes the two calls, which end a bad request
        by itself)."""
        t = time.perf_counter()
        args = self._chunk_args(plan)
        try:
            out = self.engine.step_paged(self._decode_args(rows), args)  # type: ignore[attr-defined]
        except Exception:
            log.exception("mixed step failed; its chunks and rows go again in two calls")
            return False
        if out is None:
            return False
        decoded, firsts = out
        self._chunks_done(plan, args[-1], firsts)
        self._decoded(rows, decoded, t)
        return True

    def _decode_args(self, rows: list[Request]) -> tuple[Any, ...]:
        """`decode_paged`'s arguments for the rows: keys, tables, tokens, positions, samplings."""
        return ([r.id for r in rows], [r.table.blocks for r in rows], [r.last_token for r in rows],
                [r.position for r in rows], [r.sampling for r in rows])

    def _decode_paged(self, rows: list[Request]) -> None:
        t = time.perf_counter()
        try:
            tokens = self.engine.decode_paged(*self._decode_args(rows))  # type: ignore[attr-defined]
        except Exception as exc:
            for r in rows:
                self._finish(r, "error", f"decode failed: {type(exc).__name__}: {exc}")
            return
        self._decoded(rows, tokens, t)

    def _decoded(self, rows: list[Request], tokens: list[int], t: float) -> None:
        now = time.perf_counter()
        self.step_s = 0.9 * self.step_s + 0.1 * (now - t)
        self.observer.step(len(rows), self.bucket_for(len(rows)), now - t, sum(r.position + 1 for r in rows))
        block = self.pool.block_size
        for r, token in zip(rows, tokens):
            self.observer.token_interval(now - r.last_time)
            r.last_time = now
            r.position += 1
            r.filled = r.position
            if r.position // block > r.table.named:  # a block just filled: the only time there is one to name
                self.pool.name_full_blocks(r.table, r.prompt + r.history)  # the new token not yet among them
            self._accept(r, token)

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
