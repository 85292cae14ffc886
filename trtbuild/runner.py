"""Sessions over a built engine, and the per-phase report `trtbuild run` prints.

Phases: lookup, build (0 on a hit), load, warm-up, prefill (time to first token), decode (time per
output token). Device work is timed by the engine with CUDA events or after a synchronize; warm-up
is excluded from prefill and decode; every figure is a median or percentile over many samples.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union, overload

from trtbuild import backends
from trtbuild.backends import Engine, Generation
from trtbuild.builder import BuildOutcome, Progress, build, no_build_from_env
from trtbuild.errors import (BackendUnavailableError, EngineMissingError, IncompatibleEngineError, InputError,
                             TrtbuildError)
from trtbuild.recipe import Recipe, run_shape_problems
from trtbuild.store.local import Store, verify
from trtbuild.timing import percentiles, unstable

if TYPE_CHECKING:
    from trtbuild.serving.generate import Chunk, Completion

_build = build  # open_session's `build` flag shadows the function

# Datasheet peaks (dense bf16 FLOP/s, HBM bytes/s): leads, not measurements. The benchmark measures
# the real ceilings; these only give the run report a scale.
DATASHEET_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12),
    "L40S": (362e12, 0.864e12),
}


Prompts = Union[str, list[int], list[dict[str, str]], list[str], list[list[int]], list[list[dict[str, str]]]]
_RENAMED = {"max_new_tokens": "max_tokens (the name `serve` and the OpenAI API use); the timed greedy form that "
                              "returned token ids is session.greedy(ids, max_tokens)"}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _refuse_removed(removed: dict[str, object]) -> None:
    """A keyword generate() does not take is the user's to fix: named, with its replacement when it has one (a
    renamed keyword is refused rather than mapped, because it selected another form with another return type)."""
    for name in removed:
        if name in _RENAMED:
            raise InputError(f"generate(): {name}: not a parameter; use {_RENAMED[name]}")
        raise InputError(f"generate(): {name}: not a parameter")


def _check_types(where: str, **values: tuple[object, type, bool]) -> None:
    """InputError naming every argument of the wrong type ({name: (value, type, None allowed)}); an int is a
    float here, a bool is not an int (Python's own comparisons would fail later, deep in the sampler)."""
    wrong = []
    for name, (value, kind, optional) in values.items():
        if value is None and optional:
            continue
        ok = (isinstance(value, bool) if kind is bool else _is_int(value) if kind is int
              else isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            wrong.append(f"{name}: expected {'an int' if kind is int else 'a number' if kind is float else 'a bool'}"
                         f"{' or None' if optional else ''}, got {type(value).__name__} {value!r:.40}")
    if wrong:
        raise InputError(f"{where}: " + "; ".join(wrong))


class Session:
    """An open engine. `with open_session(recipe) as s: s.generate(["Hi"], max_tokens=16)`; no device work before
    entry."""

    def __init__(self, recipe: Recipe, outcome: BuildOutcome, engines: str | os.PathLike[str] | None = None,
                 allow_build: bool = False, progress: Progress = lambda message: None) -> None:
        self.recipe = recipe
        self.outcome = outcome
        self.engines = engines
        self.allow_build = allow_build
        self.progress = progress
        self.phases: dict[str, float] = {"startup_s": outcome.startup_s, "lookup_s": outcome.lookup_s,
                                         "build_s": outcome.build_s}
        self.last: Generation | None = None
        self._engine: Engine | None = None
        self._tokenizer: Any = None
        self._text: Any = None  # generate.TextSide, read on first use

    def __enter__(self) -> "Session":
        self._stack = contextlib.ExitStack()
        try:
            self._load()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _load(self) -> None:
        store = Store(self.engines)
        moved_aside: list[str] = []  # entries found damaged at load, for the report
        for attempt in (1, 2):
            entry = self.outcome.entry
            # Held while open: prune and rm never take an engine from under a running process.
            self._stack.enter_context(store.in_use(entry.key))
            try:
                engine = backends.get(self.recipe.backend).load(entry.path, entry.manifest)
                t = time.perf_counter()
                self._engine = engine.__enter__()
            except IncompatibleEngineError as exc:
                # Built for another library version or GPU: never crash later, rebuild now if allowed.
                if attempt == 2 or not self.allow_build:
                    raise
                moved = store.quarantine(entry.path, f"{exc.reason}: {exc.message}")
                moved_aside.append(f"{entry.path.name} ({exc.reason}), moved to {moved}")
            except TrtbuildError:
                raise
            except Exception:
                # An entry already verified once gets size checks only, so a same-size flip can reach
                # the loader. If the hashes now disagree it is corruption, not a bug: quarantine it,
                # then rebuild or refuse, as for damage found at lookup.
                problems = verify(entry, full=True)
                if not problems:
                    raise
                moved = store.quarantine(entry.path, "; ".join(problems))
                moved_aside.append(f"{entry.path.name} ({'; '.join(problems)}), moved to {moved}")
                if attempt == 2 or not self.allow_build:
                    raise EngineMissingError(f"engine {entry.path.name} is corrupt ({'; '.join(problems)}); moved to "
                                             f"quarantine: {moved}", hint="build it again (`trtbuild build "
                                             f"{self.recipe.path or self.recipe.name}`)") from None
            else:
                self.phases["load_s"] = time.perf_counter() - t  # __enter__ synchronizes what it loads
                return
            self.outcome = build(self.recipe, self.engines, allow_build=True, progress=self.progress)
            self.outcome.quarantined[:0] = moved_aside
            self.phases["build_s"] += self.outcome.build_s

    def __exit__(self, *exc: object) -> None:
        if self._engine is not None:
            self._engine.__exit__(*exc)
            self._engine = None
        self._stack.close()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the session is not open; use it in a `with` block")
        return self._engine

    def warmup(self, batch_size: int, input_len: int, output_len: int) -> None:
        t = time.perf_counter()
        self.engine.warmup(batch_size, input_len, output_len)
        self.phases["warmup_s"] = self.phases.get("warmup_s", 0.0) + time.perf_counter() - t

    @overload
    def generate(self, prompts: Prompts, *, max_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] = (), repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 ignore_eos: bool = False, stream: Literal[False] = False, **removed: object) -> list[Completion]: ...

    @overload
    def generate(self, prompts: Prompts, *, max_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] = (), repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 ignore_eos: bool = False, stream: Literal[True], **removed: object) -> Iterator[Chunk]: ...

    def generate(self, prompts: Prompts, *, max_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stop_token_ids: Sequence[int] = (), repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 ignore_eos: bool = False, stream: bool = False,
                 **removed: object) -> list[Completion] | Iterator[Chunk]:
        """Generate from `prompts`: a text, a list of texts, token ids (a list of ints), a list of those, or a
        chat (a list of {"role", "content"} messages, or a list of chats, rendered by the model's template).

        Each prompt runs on its own row (prompts of any length, as many at once as the engine has rows),
        sampled as asked (temperature 0 is greedy; `seed` makes a sampled prompt's tokens repeatable whatever
        else runs beside it) until an EOS id of the model (unless `ignore_eos`), one of `stop_token_ids`, a
        `stop` string (not included in the text), or `max_tokens` new tokens (default: until max_seq_len).
        Returns one generate.Completion (token_ids, text, finish_reason) a prompt; with `stream=True` an
        iterator of generate.Chunk as the tokens come (text decoded incrementally: never half a character).
        The timed greedy form that returns token ids is `greedy()`."""
        from trtbuild.serving import generate as gen
        from trtbuild.backends.sampling import Sampling

        _refuse_removed(removed)
        _check_types("generate()", max_tokens=(max_tokens, int, True), temperature=(temperature, float, False),
                     top_k=(top_k, int, False), top_p=(top_p, float, False), seed=(seed, int, True),
                     repetition_penalty=(repetition_penalty, float, False),
                     presence_penalty=(presence_penalty, float, False), ignore_eos=(ignore_eos, bool, False),
                     stream=(stream, bool, False))
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(x, str) for x in stops):
            raise InputError(f"generate(): stop: expected a string or a list of strings, got {stop!r}")
        if not all(_is_int(x) for x in stop_token_ids):
            raise InputError(f"generate(): stop_token_ids: expected a list of ints, got {stop_token_ids!r}")
        text = self.text()
        ids = self._prompt_ids(prompts, text)
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty).checked()
        stop_ids = frozenset(stop_token_ids) | (frozenset() if ignore_eos else text.eos_ids)
        jobs = [gen.Job(p, sampling, max_tokens, stop_ids, text.watch(stops, p) if text.can_detokenize else None)
                for p in ids]
        if stops and not text.can_detokenize:
            text.watch(stops)  # the InputError that says stop strings need a tokenizer
        gen.check_jobs(self.engine, jobs)  # before any work, and before a stream's first item is asked for
        chunks = gen.stream(self.engine, jobs)
        return chunks if stream else gen.collect(chunks, len(jobs), text.can_detokenize)

    def greedy(self, input_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        """The timed greedy form `trtbuild run` and the benchmark use: token-id prompts of one length, `max_tokens`
        new tokens each, no stop condition. Returns each row's new ids; the timings are in `self.last`."""
        _check_types("greedy()", max_tokens=(max_tokens, int, False))
        if (not isinstance(input_ids, list) or not input_ids
                or not all(isinstance(r, list) and r and all(_is_int(t) for t in r) for r in input_ids)):
            raise InputError(f"greedy(): input_ids: expected a list of token-id lists, got {input_ids!r:.80}")
        if len({len(r) for r in input_ids}) != 1:
            raise InputError("greedy(): input_ids: every row needs the same length (generate() takes rows of any "
                             "lengths)")
        self.last = self.engine.generate(input_ids, max_tokens)
        return self.last.output_ids

    def text(self) -> Any:
        """The model's text side (generate.TextSide): tokenizer, chat template, EOS ids."""
        if self._text is None:
            from trtbuild.serving.generate import text_side

            self._text = text_side(self)
        return self._text

    @staticmethod
    def _prompt_ids(prompts: Any, text: Any) -> list[list[int]]:
        def one(p: Any) -> list[int]:
            if isinstance(p, str):
                return list(text.encode(p))
            if isinstance(p, list) and p and all(isinstance(m, dict) for m in p):
                return list(text.chat(p))
            if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                return list(p)
            raise InputError("prompts: expected a text, token ids, a chat (a list of messages), or a list of these")

        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and
                                        all(isinstance(x, (int, dict)) for x in prompts)):
            return [one(prompts)]
        if not isinstance(prompts, list) or not prompts:
            raise InputError("prompts: expected a text, token ids, a chat (a list of messages), or a list of these")
        return [one(p) for p in prompts]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer().encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer().decode(ids)

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            path = self.outcome.model.tokenizer
            if path is None:
                raise InputError(f"{self.recipe.path}: model.source has no tokenizer.json, so text prompts cannot be "
                                 "encoded", hint="pass token ids (--prompt-ids) instead")
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer


def open_session(recipe: Recipe, engines: str | os.PathLike[str] | None = None, build: bool = True,
                 progress: Progress = lambda message: None, verify: bool = False,
                 remote: str | None = None) -> Session:
    """Find (or pull from `remote`, or build) the engine and return a Session; enter it to load the engine."""
    allow = build and not no_build_from_env()
    _read_ahead(recipe, Store(engines))
    outcome = _build(recipe, engines, allow_build=allow, full_verify=verify, progress=progress, remote=remote)
    return Session(recipe, outcome, engines, allow_build=allow, progress=progress)


def _read_ahead(recipe: Recipe, store: Store) -> None:
    """Start reading the entry the key will most likely select while the framework imports and the device
    starts (seconds on a GPU host): onto the device where its backend can (`preload`), else, and for the
    rest of its files, into the page cache. The guess is checked where it is used: a backend takes preloaded
    weights only for the entry it loads. TRTBUILD_PREFETCH=0 turns both off."""
    if os.environ.get("TRTBUILD_PREFETCH", "1") == "0" or (entry := store.newest(recipe.name)) is None:
        return
    skip: tuple[Path, ...] = ()
    with contextlib.suppress(BackendUnavailableError):
        preload = getattr(backends.get(recipe.backend), "preload", None)  # optional: the torch backend has one
        if preload is not None:
            skip = tuple(preload(entry.path, entry.manifest))
    store.prefetch(entry, skip)


def default_prompt(batch_size: int, input_len: int, vocab_size: int) -> list[list[int]]:
    """Deterministic token ids, different per row, so runs are comparable across processes."""
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(batch_size)]


def vocab_size(recipe: Recipe, session: Session) -> int:
    cfg = getattr(session.engine, "cfg", None)
    return int(getattr(cfg, "vocab_size", 32000))


def check_run_shape(recipe: Recipe, batch_size: int, input_len: int, output_len: int, iterations: int,
                    prompt: str | None = None) -> None:
    """Raise InputError naming each flag whose value this recipe's engine cannot run. `prompt` names where
    the prompt's length came from (`--prompt`, `--prompt-ids`), so its problem is reported under that name."""
    problems = []
    for field, msg in run_shape_problems(recipe.shapes, batch_size, input_len, output_len):
        if prompt is not None and field == "input_len":  # the length is the prompt's, not a flag's
            problems.append((prompt, f"the prompt is {input_len} tokens, more than shapes.max_input_len "
                                     f"{recipe.shapes.max_input_len}"))
        elif prompt is not None and field == "output_len":
            problems.append(("--output-len", f"the prompt's {input_len} tokens + {output_len} new tokens exceed "
                                             f"shapes.max_seq_len {recipe.shapes.max_seq_len}"))
        else:
            problems.append((f"--{field.replace('_', '-')}", msg))
    if iterations < 1:
        problems.append(("--iterations", f"must be >= 1, got {iterations}"))
    if problems:
        raise InputError("; ".join(f"{flag}: {msg}" for flag, msg in problems))


def run_report(session: Session, *, batch_size: int, input_len: int, output_len: int, iterations: int,
               prompt_ids: list[list[int]] | None = None, prompt_text: str | None = None) -> dict[str, Any]:
    """Warm up, then generate `iterations` times; the report the CLI prints (or emits as JSON)."""
    recipe = session.recipe
    source = None
    if prompt_text is not None:
        prompt_ids, source = [session.encode(prompt_text)] * batch_size, "--prompt"
    elif prompt_ids is not None:
        source = "--prompt-ids"
    if prompt_ids is not None:
        batch_size, input_len = len(prompt_ids), len(prompt_ids[0])
    check_run_shape(recipe, batch_size, input_len, output_len, iterations, prompt=source)
    prompts = prompt_ids or default_prompt(batch_size, input_len, vocab_size(recipe, session))
    t_start = time.perf_counter()
    session.warmup(batch_size, input_len, output_len)
    gens = [session.engine.generate(prompts, output_len) for _ in range(iterations)]
    end_to_end = (time.perf_counter() - t_start - session.phases["warmup_s"]) / iterations
    session.last = gens[-1]
    steps = [s for g in gens for s in g.decode_step_s]
    ttft = percentiles([g.prefill_s for g in gens])
    tpot = percentiles(steps)
    decode_s = sum(sum(g.decode_step_s) for g in gens) / iterations
    outcome = session.outcome
    report: dict[str, Any] = {
        "recipe": recipe.name,
        "backend": recipe.backend,
        "device": session.engine.device,
        "engine": {"key": outcome.key, "path": str(outcome.entry.path), "cache_hit": outcome.cache_hit,
                   "store": outcome.store, "quarantined": list(outcome.quarantined),
                   "graphs_reused": list(outcome.reused),
                   "tier": outcome.fleet.get("tier", "local"), "fleet": dict(outcome.fleet)},
        "shape": {"batch_size": batch_size, "input_len": input_len, "output_len": output_len, "iterations": iterations},
        "phases": {**{k: session.phases.get(k, 0.0) for k in ("startup_s", "lookup_s", "build_s", "load_s", "warmup_s")},
                   "prefill_s": ttft["p50"], "decode_s": decode_s, "end_to_end_s": end_to_end},
        "ttft_ms": ttft["p50"] * 1e3,
        "tpot_ms": {k: v * 1e3 for k, v in tpot.items()},
        # generated tokens over the seconds that produced them, so the figure agrees with a stopwatch: the
        # decode steps' tokens over the decode time, and every new token over the whole generation
        "tokens_per_s": {"decode": batch_size * (output_len - 1) / decode_s if decode_s > 0 else 0.0,
                         "end_to_end": batch_size * output_len / end_to_end if end_to_end > 0 else 0.0},
        "output_ids": gens[-1].output_ids,
    }
    report["unstable"] = unstable(tpot)  # a sentence when the tail says the machine was busy, else None
    report["roofline"] = roofline(gens[-1], ttft["p50"], tpot["p50"], session.engine.device)
    report["load_note"] = getattr(session.engine, "load_note", "")
    report["load_parts"] = dict(getattr(session.engine, "load_parts", {}))  # torch backend: graphs, weights, constants
    on_gpu = str(session.engine.device).startswith("cuda")  # CUDA graphs and PDL mean nothing elsewhere
    launch = getattr(session.engine, "launch_report", None)  # how the decode steps launched (torch backend)
    if callable(launch) and on_gpu:
        report["decode_launch"] = launch()
    prefill = getattr(session.engine, "prefill_report", None)  # whether the prefill replayed a graph (torch)
    if callable(prefill) and on_gpu:
        report["prefill_launch"] = prefill()
    timed = getattr(session.engine, "timed_matmuls", None)  # the build's timings of the matmuls (torch backend)
    if callable(timed) and (matmuls := timed(batch_size)) is not None:
        report["decode_matmuls_timed"] = matmuls
    ranks = getattr(session.engine, "parallel_report", None)  # tensor parallel: each rank's figures and the collectives'
    if callable(ranks):
        report["parallel"] = ranks()
    if outcome.model.tokenizer is not None:
        report["output_text"] = [session.decode(row) for row in gens[-1].output_ids]
    return report


def roofline(gen: Generation, ttft_s: float, tpot_s: float, device: str) -> dict[str, Any]:
    """Achieved decode bandwidth and prefill FLOP/s, and their fraction of the device's datasheet peak."""
    out: dict[str, Any] = {}
    if gen.bytes_per_decode_step and tpot_s > 0:
        out["decode_bytes_per_token"] = gen.bytes_per_decode_step
        out["decode_bandwidth_Bps"] = gen.bytes_per_decode_step / tpot_s
    if gen.prefill_flops and ttft_s > 0:
        out["prefill_flops"] = gen.prefill_flops
        out["prefill_flops_per_s"] = gen.prefill_flops / ttft_s
    if gen.prefill_bytes and ttft_s > 0:
        out["prefill_bytes"] = gen.prefill_bytes
        out["prefill_bandwidth_Bps"] = gen.prefill_bytes / ttft_s
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(0)
        for model, (flops, bw) in DATASHEET_PEAKS.items():
            if model in name:
                out["peak_source"] = f"{model} datasheet (dense bf16, HBM)"
                if "decode_bandwidth_Bps" in out:
                    out["decode_fraction_of_peak_bandwidth"] = out["decode_bandwidth_Bps"] / bw
                if "prefill_flops_per_s" in out:
                    out["prefill_fraction_of_peak_flops"] = out["prefill_flops_per_s"] / flops
                if "prefill_bandwidth_Bps" in out:
                    out["prefill_fraction_of_peak_bandwidth"] = out["prefill_bandwidth_Bps"] / bw
                    # A short prompt cannot finish before its weights arrive, whatever its FLOPs: the roof that
                    # binds is the one it comes nearer to (a 128-token prompt at 8B reads 15 GB for 1.8 TFLOP).
                    out["prefill_bound"] = ("memory" if out["prefill_fraction_of_peak_bandwidth"]
                                            > out.get("prefill_fraction_of_peak_flops", 0.0) else "compute")
                break
    return out

