"""Request-level generation over an engine's slot API: text in and out, sampling, stop conditions, streaming.

The pieces a server needs per request, and `run`/`Session.generate` use too:
- `TextSide`: the model's tokenizer (tokenizer.json), its chat template (chat_template.jinja, or
  tokenizer_config.json's `chat_template`) and its EOS token ids (config.json and generation_config.json).
- `Detokenizer`: token ids to text as they come, never emitting half a character (a byte-level tokenizer
  splits multi-byte characters across tokens) nor any text that may turn out to begin a stop string.
- `stream`: a small continuous-batching loop that runs prompts through `prefill`/`decode`/`release`,
  admitting a waiting prompt as soon as a row frees, and yields each row's tokens and text as they come.
  The server's scheduler (scheduler.py) does the same from a thread, with a queue and metrics.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtbuild.errors import InputError
from trtbuild.backends.sampling import Sampling

# Tokens kept before the first generated one when decoding incrementally: a SentencePiece-style decoder drops
# a fragment's leading space, so text is always decoded from a few tokens back (vLLM's prefix offset).
CONTEXT_TOKENS = 5


def eos_ids(folder: Path | None, config: dict[str, Any] | None = None) -> frozenset[int]:
    """The model's end-of-sequence ids: config.json's and generation_config.json's `eos_token_id` (an int or
    a list), together. `config` stands in for config.json where the folder is not at hand."""
    found: set[int] = set()
    docs = [config or {}]
    for name in ("config.json", "generation_config.json"):
        if folder is not None and (folder / name).is_file():
            docs.append(json.loads((folder / name).read_text()))
    for doc in docs:
        value = doc.get("eos_token_id")
        found.update([value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)])
    return frozenset(found)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def chat_template(folder: Path | None) -> tuple[str | None, dict[str, Any]]:
    """The chat template (chat_template.jinja first, as transformers reads it, then tokenizer_config.json's
    `chat_template`, its "default" entry where it is a list of named templates) and the special tokens the
    template may name (bos_token, eos_token, ...)."""
    if folder is None:
        return None, {}
    cfg: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(), specials
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return (template if isinstance(template, str) else None), specials


def render_chat(template: str, messages: list[dict[str, Any]], specials: dict[str, Any],
                add_generation_prompt: bool = True) -> str:
    """The conversation as the model was trained to read it, rendered as transformers renders chat templates
    (a sandboxed Jinja environment with trim_blocks, lstrip_blocks, `raise_exception` and `strftime_now`)."""
    from datetime import datetime

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **{k: v for k, v in specials.items() if v is not None})
    except TemplateError as exc:
        raise InputError(f"messages: the model's chat template refused them: {exc}") from None


class Detokenizer:
    """One request's generated tokens as text (scheduler.TextWatch): `feed` returns the text that became final
    with each token and whether a stop string has appeared (the text then ends before it); `flush` the text
    held back, once the request ends otherwise. Text is held back while it ends in an incomplete character
    (the decoder's U+FFFD) or in a prefix of a stop string."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids = list(context[-CONTEXT_TOKENS:]) if context else []
        self.prefix = 0  # ids[prefix:read] decode to text already taken; ids[prefix:] to that and what is new
        self.read = len(self.ids)
        self.text = ""  # every character decoded from the generated tokens, final or held back
        self.sent = 0  # how much of `text` was emitted
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _take(self, final: bool) -> None:
        """Move what the tokens since `read` decode to into `text` (unless it ends mid-character and more may come)."""
        before = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) <= len(before) or (full.endswith("\ufffd") and not final):
            return
        self.text += full[len(before):]
        self.prefix, self.read = self.read, len(self.ids)

    def feed(self, token: int) -> tuple[str, bool]:
        """The text that became final with this token, and whether a stop string now appears."""
        if self.stopped:
            return "", True
        self.ids.append(token)
        self._take(final=False)
        return self._release()

    def _release(self) -> tuple[str, bool]:
        pending = self.text[self.sent:]
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:  # the text ends where the first stop string begins
            self.stopped = True
            out = pending[:min(hits)]
            self.sent = len(self.text)
            return out, True
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(pending)), 0, -1)
                    if pending.endswith(s[:n])), default=0)
        out = pending[:len(pending) - hold]
        self.sent += len(out)
        return out, False

    def flush(self) -> str:
        """What was held back: the end of the text, a partial stop string included (it never completed)."""
        if self.stopped:
            return ""
        self._take(final=True)
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


@dataclass
class TextSide:
    """A model's text interface: encode, chat, detokenize, EOS. Any part may be missing (a synthetic model
    has no tokenizer); `can_encode`/`can_detokenize` say which."""

    tokenizer: Any = None
    template: str | None = None
    specials: dict[str, Any] = field(default_factory=dict)
    eos_ids: frozenset[int] = frozenset()
    where: str = "the model"  # named in errors

    @classmethod
    def from_folder(cls, folder: Path | None, config: dict[str, Any] | None = None) -> "TextSide":
        """Everything the model folder has: tokenizer.json, the chat template, the EOS ids."""
        tokenizer = None
        if folder is not None and (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        template, specials = chat_template(folder)
        return cls(tokenizer, template, specials, eos_ids(folder, config), str(folder) if folder else "the model")

    @property
    def can_encode(self) -> bool:
        return self.tokenizer is not None

    @property
    def can_detokenize(self) -> bool:
        return self.tokenizer is not None

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise InputError(f"{what}: {self.where} has no tokenizer.json, so text cannot be encoded or decoded",
                             hint="pass token ids instead")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, special tokens added as the tokenizer's post-processor says (BOS)."""
        return list(self._need_tokenizer("prompt").encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._need_tokenizer("output").decode(list(ids), skip_special_tokens=True))

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation rendered by the chat template and encoded; the template writes its special tokens
        itself, so none are added (transformers' apply_chat_template)."""
        tokenizer = self._need_tokenizer("messages")
        if self.template is None:
            raise InputError(f"messages: {self.where} has no chat template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template)", hint="send a completion prompt instead")
        if not messages or any(not isinstance(m, dict) or "role" not in m for m in messages):
            raise InputError("messages: expected a non-empty list of {role, content} objects")
        text = render_chat(self.template, messages, self.specials)
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    def watch(self, stops: Sequence[str] = (), context: Sequence[int] = ()) -> Detokenizer:
        """A fresh detokenizer for one request (scheduler.TextWatch)."""
        return Detokenizer(self._need_tokenizer("stop"), stops, context)


def text_side(session: Any) -> TextSide:
    """The TextSide of an open session's model (its folder, else the engine's recorded config for EOS)."""
    model = session.outcome.model
    folder = getattr(model, "folder", None)
    config = getattr(getattr(session, "engine", None), "spec", {}).get("hf_config")
    return TextSide.from_folder(folder if folder is not None and folder.is_dir() else None, config)


@dataclass
class Job:
    """One prompt to run: its ids, how to sample, when to stop."""

    prompt: list[int]
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None  # None: until max_seq_len
    stop_ids: frozenset[int] = frozenset()
    watch: Detokenizer | None = None


@dataclass(frozen=True)
class Chunk:
    """What `stream` yields: a generated token of job `index` with the text it made final, or the job's end
    (`finish_reason` "stop" or "length", `token` None, `text` what was held back)."""

    index: int
    token: int | None
    text: str
    finish_reason: str | None = None


def check_jobs(engine: Any, jobs: Sequence[Job]) -> None:
    """InputError naming the limit a job exceeds; a prompt is never truncated."""
    for i, job in enumerate(jobs):
        n = len(job.prompt)
        if n == 0:
            raise InputError(f"prompt {i}: empty")
        if n > engine.max_input_len or n >= engine.max_seq_len:
            raise InputError(f"prompt {i}: {n} tokens, more than the engine's max_input_len {engine.max_input_len}"
                             if n > engine.max_input_len else
                             f"prompt {i}: {n} tokens leave no room below the engine's max_seq_len {engine.max_seq_len}")
        if job.max_tokens is not None and job.max_tokens < 1:
            raise InputError(f"max_tokens: must be >= 1, got {job.max_tokens}")
        if job.max_tokens is not None and n + job.max_tokens > engine.max_seq_len:
            raise InputError(f"max_tokens: a prompt of {n} tokens and {job.max_tokens} new ones exceed the engine's "
                             f"max_seq_len {engine.max_seq_len}")
        job.sampling.checked()


@dataclass
class _Row:
    index: int
    job: Job
    last: int = 0  # the token to feed next
    position: int = 0  # its position
    generated: int = 0


def stream(engine: Any, jobs: Sequence[Job]) -> Iterator[Chunk]:
    """Run the jobs through the engine's slots, as many at once as it has rows, admitting the next waiting job
    the moment a row frees; yield every generated token as it comes and each job's end. A stop token (EOS or
    the job's) ends its job and is not yielded. Slots are released even if the caller stops iterating."""
    check_jobs(engine, jobs)
    waiting = deque(enumerate(jobs))
    free = list(range(engine.max_batch_size))
    running: dict[int, _Row] = {}
    try:
        while waiting or running:
            while waiting and free:  # the lowest rows first, so the running rows stay in the smallest bucket
                index, job = waiting.popleft()
                slot = free.pop(0)
                row = _Row(index, job, position=len(job.prompt))
                running[slot] = row
                token = engine.prefill(slot, job.prompt, job.sampling)
                yield from _take(engine, slot, row, token, running, free)
            if not running:
                continue
            slots = sorted(running)
            rows = [running[s] for s in slots]
            tokens = engine.decode(slots, [r.last for r in rows], [r.position for r in rows],
                                   [r.job.sampling for r in rows])
            for slot, row, token in zip(slots, rows, tokens):
                row.position += 1
                yield from _take(engine, slot, row, token, running, free)
    finally:
        for slot in running:
            engine.release(slot)


def _take(engine: Any, slot: int, row: _Row, token: int, running: dict[int, _Row], free: list[int]) -> Iterator[Chunk]:
    """Deliver one generated token of a row, or end the row on it (freeing its slot)."""
    job = row.job
    finish = None
    if token in job.stop_ids:
        finish = "stop"
    else:
        row.generated += 1
        row.last = token
        text, stopped = job.watch.feed(token) if job.watch is not None else ("", False)
        yield Chunk(row.index, token, text)
        budget = job.max_tokens if job.max_tokens is not None else engine.max_seq_len
        if stopped:
            finish = "stop"
        elif row.generated >= budget or row.position + 1 >= engine.max_seq_len:  # prompt + output fill it
            finish = "length"
    if finish is None:
        return
    del running[slot]
    engine.release(slot)
    free.append(slot)
    free.sort()
    held = "" if job.watch is None or job.watch.stopped else job.watch.flush()
    yield Chunk(row.index, None, held, finish)


@dataclass
class Completion:
    """One finished job: its generated ids (a stop token not included), its text (None without a tokenizer)
    and why it ended ("stop" or "length")."""

    token_ids: list[int]
    text: str | None
    finish_reason: str


def collect(chunks: Iterator[Chunk], n: int, with_text: bool) -> list[Completion]:
    """The completions of `n` jobs from their chunks, in job order."""
    ids: list[list[int]] = [[] for _ in range(n)]
    texts = [""] * n
    reasons = [""] * n
    for c in chunks:
        if c.token is not None:
            ids[c.index].append(c.token)
        texts[c.index] += c.text
        if c.finish_reason is not None:
            reasons[c.index] = c.finish_reason
    return [Completion(i, t if with_text else None, r) for i, t, r in zip(ids, texts, reasons)]
