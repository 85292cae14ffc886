"""The engine's paged slot API (`trtbuild serve` over a block pool: serving/paged_steps.py): requests' prompt
chunks and decode steps through their block tables, both in one call of the mixed step, and steps launched
before the step before is read back (`launch_paged`, `LaunchedStep`). Mixed into backends/torch/runtime's
TorchEngine; the pools and the calls' inputs are paged_runtime.PagedCache's."""

from __future__ import annotations

from typing import Any, Callable

from trtbuild.backends.sampling import Sampling
from trtbuild.backends.torch.paged_runtime import PagedCache, pool_blocks
from trtbuild.errors import InputError
from trtbuild.timing import sync


class PagedSlots:
    """The engine's paged slot API (`trtbuild serve` over a block pool), mixed into backends/torch/runtime's
    TorchEngine, whose loaded packages, constants, prompt histories and sampling it uses. Keys are requests'
    ids; each call names the blocks of each request's table."""

    cfg: Any
    device: str
    max_seq_len: int
    max_input_len: int
    vocab_size: int
    paged: "PagedCache | None"
    kv_capacity_tokens: int
    kv_layout: str
    _packages: dict[str, Any]
    _consts: dict[str, Any]
    _prompts: dict[int, list[int]]
    _generated: dict[int, list[int]]
    _launched: "LaunchedStep | None"  # the last step `launch_paged` launched; None after any other paged call
    # A step's prompt chunks replay their captured chunk graph beside the decode rows' graph (two captured calls)
    # where a chunk bucket holds them, instead of the mixed step: its ~200 kernels are launched from the host one by
    # one, which a busy host can fall behind (`open_pool`'s `captured_chunks`; serve --captured-chunks)
    captured_chunks: bool = False
    # A launched step's decode rows and chunks replay a captured graph of the mixed step where a bucket holds them
    # with little padding (backends/torch/mixed_graphs.py; `open_pool`'s `captured_mixed`, off with serve
    # --no-captured-mixed); else the mixed step is called directly
    captured_mixed: bool = True

    def _sample(self, logits: Any, slots: list[int], positions: list[int], params: list[Sampling]) -> Any:
        raise NotImplementedError

    @property
    def can_page(self) -> bool:
        return "paged" in self._packages

    def open_pool(self, fraction: float = 0.9, blocks: int | None = None, captured_chunks: bool = False,
                  captured_mixed: bool = True) -> int:
        """Allocate the block pools (`paged_runtime.pool_blocks` says how many blocks); their count. From now on
        the paged calls' keys are requests' ids, not cache rows (a server uses one API or the other).
        `captured_chunks`, `captured_mixed`: see the attributes."""
        dtype = self._consts["model.tok_embeddings.weight"].dtype
        n = pool_blocks(self.cfg, dtype.itemsize, self.device, self.max_seq_len, fraction, blocks)
        self.paged = PagedCache(self._packages["paged"], self.cfg, n, dtype, self.device, self.max_seq_len,
                                max_input_len=self.max_input_len, mixed=self._packages.get("paged_mixed"))
        sync(self.device)
        self.captured_chunks, self.captured_mixed = captured_chunks, captured_mixed
        self.kv_capacity_tokens = n * self.paged.block_size
        self.kv_layout = f"paged: {n} blocks of {self.paged.block_size} tokens"
        return n

    @property
    def can_mix(self) -> bool:
        """Whether a step's decode rows and prompt chunks can go in one step (`step_paged`): one call of the mixed
        step, or two captured ones."""
        return self.paged is not None and (self.paged.mixed_package is not None or bool(self.chunk_buckets))

    @property
    def chunk_buckets(self) -> list[tuple[int, int]]:
        """The (rows, tokens a row) shapes whose captured graphs a step's chunks replay (`captured_chunks`), for
        the scheduler to plan chunks to; [] where steps do not use them."""
        if not self.captured_chunks or self.paged is None or self.paged.chunks is None:
            return []
        return list(self.paged.chunks.sizes)

    def _rows_and_chunks(self, blocks: list[list[int]], tokens: list[int], positions: list[int],
                         cblocks: list[list[int]], ctokens: list[list[int]], starts: list[int],
                         feed: Callable[[Any], None] | None = None, logits: bool = True) -> tuple[Any, Any] | None:
        """A step's decode rows and prompt chunks: (greedy (Bd + Bc, 1), logits (Bd + Bc, V) or None where not
        `logits`), the rows' first: where only the greedy tokens are wanted (a launched step), the mixed step's
        captured graph where `captured_mixed` and a bucket holds the call; the chunks' captured graph, then the
        rows', where `captured_chunks` and a bucket holds the chunks; else one call of the mixed step. None where
        none can take them."""
        import torch

        if not logits and self.captured_mixed and not self.captured_chunks and self.paged.mixed_graphs is not None:
            greedy = self.paged.mixed_graphs.run(blocks, tokens, positions, cblocks, ctokens, starts, feed)
            if greedy is not None:
                return greedy, None
        if self.captured_chunks and self.paged.chunks is not None:
            chunked = self.paged.chunks.run(cblocks, ctokens, starts)
            if chunked is not None:
                rows = self.paged.decode(blocks, tokens, positions, feed)
                return (torch.cat([rows[0], chunked[0]]),
                        torch.cat([rows[1], chunked[1]]) if logits else None)
        return self.paged.mixed(blocks, tokens, positions, cblocks, ctokens, starts, feed)

    def prefill_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[list[int]], starts: list[int],
                      sampling: list[Sampling], lasts: list[bool]) -> list[int | None]:
        """Write prompt chunks' KV, chunk i at positions starts[i].. through the block table blocks[i], all in
        one call of the paged graph; for each chunk whose `lasts` entry is true, the token that follows it (the
        first generated token when the chunk ends its prompt), else None. Where no chunk is last the host does
        not wait for the device: the next call queues behind these."""
        self._check_chunks(keys, blocks, tokens, starts, sampling, lasts)
        self._launched = None
        if len(keys) == 1:
            greedy, logits = self.paged.prefill(blocks[0], tokens[0], starts[0])
        else:
            greedy, logits = self.paged.prefill_many(blocks, tokens, starts)
        return self._chunks_done(greedy, logits, keys, tokens, starts, sampling, lasts)

    def decode_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[int], positions: list[int],
                     sampling: list[Sampling]) -> list[int]:
        """One decode step of any rows, each through its block table at its own position."""
        self._check_decode(keys, blocks, tokens, positions, sampling)
        self._launched = None
        greedy, logits = self.paged.decode(blocks, tokens, positions)
        return self._decoded(greedy, logits, keys, tokens, positions, sampling)

    def step_paged(self, decode: tuple[list[int], list[list[int]], list[int], list[int], list[Sampling]],
                   chunks: tuple[list[int], list[list[int]], list[list[int]], list[int], list[Sampling], list[bool]]
                   ) -> tuple[list[int], list[int | None]] | None:
        """A decode step (`decode_paged`'s arguments) and prompt chunks (`prefill_paged`'s) in one call of the
        mixed step, so the step reads each weight once: (the decode rows' tokens, the chunks' as `prefill_paged`
        gives them). None, with nothing run, where the engine has no mixed step or the chunks cannot go in one
        call with the rows; the caller then makes the two calls."""
        keys, blocks, tokens, positions, sampling = decode
        self._check_decode(keys, blocks, tokens, positions, sampling)
        self._check_chunks(*chunks)
        ckeys, cblocks, ctokens, starts, csampling, lasts = chunks
        self._launched = None
        out = self._rows_and_chunks(blocks, tokens, positions, cblocks, ctokens, starts)
        if out is None:
            return None
        greedy, logits = out
        n = len(keys)
        return (self._decoded(greedy[:n], logits[:n], keys, tokens, positions, sampling),
                self._chunks_done(greedy[n:], logits[n:], ckeys, ctokens, starts, csampling, lasts))

    @property
    def can_overlap(self) -> bool:
        """Whether steps can be launched before the step before is read back (`launch_paged`)."""
        return self.paged is not None

    def launch_paged(self, decode: tuple[list[int], list[list[int]], list[int], list[int], list[Sampling]],
                     chunks: tuple[list[int], list[list[int]], list[list[int]], list[int], list[Sampling],
                                   list[bool]] | None,
                     fed: list[tuple[int, int]]) -> "LaunchedStep | None":
        """Launch a decode step (`decode_paged`'s arguments), with prompt chunks in the same call of the mixed
        step where `chunks` are given (`prefill_paged`'s), without waiting for it: the host goes on (delivering
        the step before's tokens) while the device runs it. `fed` names the decode rows whose token is the last
        launched step's output, (row, index into that step's rows): it is copied on the device, so a step can
        be launched before the host knows its tokens. Every row greedy (the engine's own argmax; a sampled row's
        penalties need its tokens on the host). None, with nothing launched, where the chunks cannot go in one
        call with the rows."""
        keys, blocks, tokens, positions, sampling = decode
        self._check_decode(keys, blocks, tokens, positions, sampling)
        if chunks is not None:
            self._check_chunks(*chunks)
        if not all(s.greedy for s in [*sampling, *(chunks[4] if chunks else [])]):
            raise InputError("a launched step's rows must all be greedy")
        started = LaunchedStep.mark(self.device)
        feed = self._feeder(fed)
        if chunks is None:
            greedy, _ = self.paged.decode(blocks, tokens, positions, feed)
            lasts: list[bool] = []
        else:
            ckeys, cblocks, ctokens, starts, _, lasts = chunks
            out = self._rows_and_chunks(blocks, tokens, positions, cblocks, ctokens, starts, feed, logits=False)
            if out is None:
                return None
            greedy = out[0]
            self._note_chunks(ckeys, ctokens, starts)
        self._launched = LaunchedStep(greedy, len(keys), lasts, self.device, started)
        return self._launched

    def _feeder(self, fed: list[tuple[int, int]]) -> Callable[[Any], None] | None:
        """What writes the fed rows' tokens from the last launched step's greedy output, on the device. Its
        indices go up through the pinned uploads: a pageable copy would make the host wait for the step in flight
        before launching this one."""
        import numpy as np

        if not fed:
            return None
        before = self._launched
        if before is None:
            raise InputError("a step names tokens of a step before, and none was launched since the last call")
        rows, source = self.paged.upload(np.fromiter((r for r, _ in fed), dtype=np.int64, count=len(fed)),
                                         np.fromiter((i for _, i in fed), dtype=np.int64, count=len(fed)))

        def feed(column: Any) -> None:
            column[rows] = before.greedy[source, 0]
        return feed

    def _check_chunks(self, keys: list[int], blocks: list[list[int]], tokens: list[list[int]], starts: list[int],
                      sampling: list[Sampling], lasts: list[bool]) -> None:
        n = len(keys)
        if not n or not len(blocks) == len(tokens) == len(starts) == len(sampling) == len(lasts) == n:
            raise InputError("prefill: expected as many tables, chunks, starts, samplings and flags as keys")
        for chunk, start, plan in zip(tokens, starts, sampling):
            if not chunk or start + len(chunk) >= self.max_seq_len or len(chunk) > self.max_input_len:
                raise InputError(f"a chunk of {len(chunk)} tokens at {start} does not fit the engine")
            if any(not 0 <= tok < self.vocab_size for tok in chunk):
                raise InputError(f"prompt: token ids must be in [0, {self.vocab_size})")
            plan.checked()

    def _chunks_done(self, greedy: Any, logits: Any, keys: list[int], tokens: list[list[int]], starts: list[int],
                     sampling: list[Sampling], lasts: list[bool]) -> list[int | None]:
        """After a call's chunks: each prompt so far noted (the penalties' history), each last chunk's token."""
        n = len(keys)
        self._note_chunks(keys, tokens, starts)
        out: list[int | None] = [None] * n
        wanted = [i for i in range(n) if lasts[i]]
        if not wanted:
            return out
        picked = greedy[wanted, 0].tolist()
        sampled = [i for i in wanted if not sampling[i].greedy]
        if sampled:
            draws = self._sample(logits[sampled], [keys[i] for i in sampled],
                                 [starts[i] + len(tokens[i]) - 1 for i in sampled], [sampling[i] for i in sampled])
            for i, tok in zip(sampled, draws.tolist()):
                picked[wanted.index(i)] = tok
        for i, tok in zip(wanted, picked):
            out[i] = int(tok)
        return out

    def _note_chunks(self, keys: list[int], tokens: list[list[int]], starts: list[int]) -> None:
        for key, chunk, start in zip(keys, tokens, starts):
            if start == 0 or key not in self._prompts:  # a first chunk (after a cached prefix, start > 0)
                self._prompts[key], self._generated[key] = [], []
            self._prompts[key] += chunk

    def _check_decode(self, keys: list[int], blocks: list[list[int]], tokens: list[int], positions: list[int],
                      sampling: list[Sampling]) -> None:
        n = len(keys)
        if not n or not len(blocks) == len(tokens) == len(positions) == len(sampling) == n:
            raise InputError("decode: expected as many tables, tokens, positions and samplings as keys")
        if any(not 0 < p < self.max_seq_len for p in positions):
            raise InputError(f"decode: positions must be in [1, max_seq_len {self.max_seq_len}), got {positions}")

    def _decoded(self, greedy: Any, logits: Any, keys: list[int], tokens: list[int], positions: list[int],
                 sampling: list[Sampling]) -> list[int]:
        """A decode step's tokens. The token fed is the last one generated: the penalties' history has it before
        this step samples (a prompt chunk cannot know whether its token is the first generated one)."""
        import torch

        for key, tok in zip(keys, tokens):
            self._generated.setdefault(key, []).append(tok)
        if all(s.greedy for s in sampling):
            return greedy[:, 0].tolist()
        picked = self._sample(logits, keys, positions, sampling)
        both = torch.stack([greedy[:, 0], picked]).tolist()
        return [g if s.greedy else p for g, p, s in zip(both[0], both[1], sampling)]

    def capture_paged(self) -> int:
        """Capture the paged decode step's graph of every row-count bucket, the small prompt-chunk calls' graphs and
        the mixed step's (`captured_mixed`), now (CUDA, where the paged kernel serves the model); how many graphs
        are captured. Safe with requests in the pool: a capture writes only the scratch block."""
        if self.paged is None or self.paged.graphs is None:
            return 0
        self.paged.graphs.capture_all()
        extra = [self.paged.chunks, self.paged.mixed_graphs if self.captured_mixed else None]
        for graphs in extra:
            if graphs is not None:
                graphs.capture_all()
        return len(self.paged.graphs.graphs) + sum(len(g.graphs) for g in extra if g is not None)


class LaunchedStep:
    """A paged step launched and not yet read back. Its greedy tokens are copied to pinned host memory behind it
    on the device's stream; `result` waits for that copy alone. `greedy` stays on the device for the next
    step's fed rows (PagedSlots.launch_paged). On CUDA, after `result`, `device_seconds` is the step's time on
    the device from `started` (recorded before its first copy) to its tokens' copy: what the server's
    device-busy counter sums."""

    def __init__(self, greedy: Any, rows: int, lasts: list[bool], device: str, started: Any = None) -> None:
        import torch

        self.greedy, self.rows, self.lasts = greedy, rows, lasts
        cuda = device.startswith("cuda")
        self._host = torch.empty(greedy.shape[0], dtype=greedy.dtype, pin_memory=cuda)
        self._host.copy_(greedy[:, 0], non_blocking=cuda)
        self._started, self._done = started, None
        self.device_seconds: float | None = None
        if cuda:
            self._done = torch.cuda.Event(enable_timing=started is not None)
            self._done.record()

    @staticmethod
    def mark(device: str) -> Any:
        """A timing event recorded on the device's stream now (CUDA), else None."""
        if not device.startswith("cuda"):
            return None
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def result(self) -> tuple[list[int], list[int | None]]:
        """(the decode rows' tokens, each chunk's token where its `lasts` entry is true, else None)."""
        if self._done is not None:
            self._done.synchronize()
            if self._started is not None:
                self.device_seconds = self._started.elapsed_time(self._done) / 1e3
        values = self._host.tolist()
        n = self.rows
        return values[:n], [values[n + i] if last else None for i, last in enumerate(self.lasts)]
