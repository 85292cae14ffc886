"""`trtbuild build` and `trtbuild run`: the engine found or built, then run and reported, or generating text."""

from __future__ import annotations

import json
import re
from typing import Any

import click

from trtbuild.cli.common import (build_progress, engines_option, fleet_line, json_option, load_recipe_file,
                                 quiet_option, recipe_arg, remote_option, threads_option)
from trtbuild.errors import InputError


@click.command("build")
@recipe_arg
@engines_option
@click.option("--verify", is_flag=True, help="Hash every file of a cached engine (sizes are always checked).")
@json_option
@quiet_option
@remote_option
def build_cmd(recipe: str, engines: str | None, verify: bool, as_json: bool, quiet: bool, remote: str | None) -> None:
    """Build the recipe's engine, or find it in the store."""
    from trtbuild.builder import build

    r = load_recipe_file(recipe)
    with build_progress(as_json or quiet) as progress:
        outcome = build(r, engines, full_verify=verify, progress=progress, remote=remote)
    result = {"recipe": r.name, "backend": r.backend,
              "engine": {"key": outcome.key, "path": str(outcome.entry.path), "cache_hit": outcome.cache_hit,
                         "store": outcome.store, "quarantined": outcome.quarantined},
              "startup_s": outcome.startup_s, "lookup_s": outcome.lookup_s, "build_s": outcome.build_s,
              "phases": outcome.phases,
              "waited_for": outcome.waited_for, "fleet": outcome.fleet}
    if as_json:
        click.echo(json.dumps(result))
        return
    state = "cache hit" if outcome.cache_hit else f"built in {outcome.build_s:.1f} s"
    for damaged in outcome.quarantined:
        click.echo(f"corrupt entry {damaged}")
    click.echo(f"{r.name}: {state}\n  key   {outcome.key}\n  path  {outcome.entry.path}\n  store {outcome.store}")
    if outcome.fleet.get("url"):
        click.echo(f"  remote {fleet_line(outcome.fleet)}")
    for name, seconds in outcome.phases.items():
        click.echo(f"  {name:<16} {seconds:8.2f} s")


def _parse_ids(text: str | None) -> list[list[int]] | None:
    if text is None:
        return None
    try:
        rows = [[int(tok) for tok in row.split(",") if tok.strip()] for row in text.split(";")]
    except ValueError:
        raise InputError(f"--prompt-ids: expected comma-separated integers (rows separated by ';'), got {text!r}") from None
    if not rows or not all(rows) or len({len(r) for r in rows}) != 1:
        raise InputError("--prompt-ids: every row needs the same, non-zero number of tokens")
    return rows


_ESCAPE = re.compile(r"\\(?:([abefnrtv\\\"'])|x([0-9A-Fa-f]{1,2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|([0-7]{1,3}))")
_SIMPLE = {"a": "\a", "b": "\b", "e": "\x1b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
           "\\": "\\", '"': '"', "'": "'"}


def unescape(text: str) -> str:
    """The escapes `printf` interprets (\\n, \\t, \\\\, \\xHH, \\uHHHH, \\NNN octal...), because a shell passes
    `--stop "\\n"` as a backslash and an n, and a stop string of those two characters is never what was meant.
    An unknown escape stays as written, as printf leaves it."""
    def one(m: re.Match[str]) -> str:
        simple, hex2, hex4, hex8, octal = m.groups()
        if simple is not None:
            return _SIMPLE[simple]
        code = int(hex2 or hex4 or hex8, 16) if octal is None else int(octal, 8)
        return chr(code) if code <= 0x10FFFF else m.group(0)  # beyond Unicode: left as written

    return _ESCAPE.sub(one, text)


def _unescape_all(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    for v in values:
        if not unescape(v):
            raise click.BadParameter(f"{v!r} is empty once its escapes are read", ctx, param)
    return tuple(unescape(v) for v in values)


@click.command("run")
@recipe_arg
@engines_option
@click.option("--no-build", is_flag=True, help="Never build; a missing engine is an error (also TRTBUILD_NO_BUILD=1).")
@click.option("--batch-size", type=int, default=None)
@click.option("--input-len", type=int, default=None)
@click.option("--output-len", type=int, default=None)
@click.option("--prompt-ids", default=None, help="Token ids, e.g. 1,2,3 (rows separated by ';').")
@click.option("--prompt", "prompt_text", default=None, help="Text prompt (needs the model's tokenizer.json).")
@click.option("--chat", "chat_text", default=None,
              help="A user message, rendered by the model's chat template; generates the reply as text.")
@click.option("--temperature", type=float, default=None, help="Sample at this temperature (0: greedy); generates text.")
@click.option("--top-k", type=int, default=None, help="Sample among the k most likely tokens (0: all).")
@click.option("--top-p", type=float, default=None, help="Sample among the most likely tokens holding this probability.")
@click.option("--seed", type=int, default=None, help="Seed of the sampling: the same seed gives the same text.")
@click.option("--stop", multiple=True, callback=_unescape_all,
              help="A stop string (repeatable; needs the tokenizer); not included in the text. Escapes are read as "
                   "printf reads them: \"\\n\\n\" is a blank line.")
@click.option("--iterations", type=int, default=3, show_default=True)
@click.option("--verify", is_flag=True, help="Hash every engine file before loading (sizes are always checked).")
@threads_option
@json_option
@quiet_option
@remote_option
def run_cmd(recipe: str, engines: str | None, no_build: bool, batch_size: int | None, input_len: int | None,
            output_len: int | None, prompt_ids: str | None, prompt_text: str | None, chat_text: str | None,
            temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None,
            stop: tuple[str, ...], iterations: int, verify: bool, threads: int | None, as_json: bool, quiet: bool,
            remote: str | None) -> None:
    """Find (or build) the engine, run it, and report every phase. With --chat or a sampling flag (--temperature,
    --top-k, --top-p, --seed, --stop): generate text from the prompt instead, streamed as it comes."""
    from trtbuild.measure.report import print_table
    from trtbuild.runner import check_run_shape, open_session, run_report
    from trtbuild.timing import use_threads

    r = load_recipe_file(recipe)
    threads_used = use_threads(threads)  # before the build and the run: both use torch's thread pool
    if chat_text is not None or stop or any(v is not None for v in (temperature, top_k, top_p, seed)):
        sampling = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                      ("seed", seed)) if v is not None}
        _run_text(r, engines, no_build, verify, remote, as_json, quiet, prompt_text, prompt_ids, chat_text,
                  batch_size, input_len, output_len, sampling, list(stop))
        return
    ids = _parse_ids(prompt_ids)
    if ids is not None and prompt_text is not None:
        raise InputError("--prompt and --prompt-ids: give one of them")
    if ids is not None and batch_size is not None and batch_size != len(ids):
        raise InputError(f"--batch-size {batch_size} but --prompt-ids has {len(ids)} row(s): the rows are the batch; "
                         "drop --batch-size or give one row per sequence (rows separated by ';')")
    if ids is not None and input_len is not None and input_len != len(ids[0]):
        raise InputError(f"--input-len {input_len} but --prompt-ids rows have {len(ids[0])} tokens: drop --input-len")
    if prompt_text is not None and input_len is not None:
        raise InputError("--input-len and --prompt: the prompt's own length is the input length; drop --input-len")
    # `is None`, not `or`: a 0 given on the command line is refused by name, never replaced by the default
    shape = {"batch_size": r.run.batch_size if batch_size is None else batch_size,
             "input_len": r.run.input_len if input_len is None else input_len,
             "output_len": r.run.output_len if output_len is None else output_len}
    if prompt_text is None:  # checked before the engine loads (a text prompt's length is known once tokenized)
        given = {"batch_size": len(ids), "input_len": len(ids[0])} if ids else {}
        check_run_shape(r, **(shape | given), iterations=iterations, prompt="--prompt-ids" if ids else None)
    with build_progress(as_json or quiet) as progress:
        session = open_session(r, engines, build=not no_build, progress=progress, verify=verify, remote=remote)
    with session:
        report = run_report(session, **shape, iterations=iterations, prompt_ids=ids, prompt_text=prompt_text)
    report["threads"] = threads_used
    if as_json:
        click.echo(json.dumps(report))
    else:
        print_table(report)


def _run_text(r: Any, engines: str | None, no_build: bool, verify: bool, remote: str | None, as_json: bool,
              quiet: bool, prompt_text: str | None, prompt_ids: str | None, chat_text: str | None,
              batch_size: int | None, input_len: int | None, output_len: int | None, sampling: dict[str, Any],
              stop: list[str]) -> None:
    """`run` generating text: one prompt (or --prompt-ids rows), sampled, stopped, printed as it comes."""
    import time

    from trtbuild.runner import open_session

    given = [name for name, v in (("--prompt", prompt_text), ("--prompt-ids", prompt_ids), ("--chat", chat_text))
             if v is not None]
    if len(given) != 1:
        raise InputError(f"{' and '.join(given) or '--prompt, --prompt-ids or --chat'}: give one prompt to generate "
                         "from")
    for flag, v in (("--batch-size", batch_size), ("--input-len", input_len)):
        if v is not None:
            raise InputError(f"{flag}: generating text, the prompt sets the batch and the length; drop {flag}")
    if output_len is not None and output_len < 1:
        raise InputError(f"--output-len: must be >= 1, got {output_len}")
    prompts: Any = (prompt_text if prompt_text is not None else _ragged_ids(prompt_ids) if prompt_ids is not None
                    else [{"role": "user", "content": chat_text}])
    with build_progress(as_json or quiet) as progress:
        session = open_session(r, engines, build=not no_build, progress=progress, verify=verify, remote=remote)
    with session:
        t = time.perf_counter()
        chunks = session.generate(prompts, max_tokens=output_len, stop=stop, stream=True, **sampling)
        texts: dict[int, str] = {}
        ids: dict[int, list[int]] = {}
        reasons: dict[int, str] = {}
        for c in chunks:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.token is not None:
                ids.setdefault(c.index, []).append(c.token)
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
            if not as_json and c.text and len(given) == 1 and prompt_ids is None:
                click.echo(c.text, nl=False)  # one text prompt: its text as it comes
        seconds = time.perf_counter() - t
    n = max(len(reasons), 1)
    completions = [{"text": texts.get(i, "") if session.text().can_detokenize else None,
                    "token_ids": ids.get(i, []), "finish_reason": reasons.get(i, "")} for i in range(n)]
    if as_json:
        click.echo(json.dumps({"recipe": r.name, "sampling": sampling, "stop": stop, "seconds": seconds,
                               "completions": completions}))
        return
    if prompt_ids is not None:
        for c in completions:
            click.echo(c["text"] if c["text"] is not None else ",".join(map(str, c["token_ids"])))
    else:
        click.echo()
    if not quiet:
        tokens = sum(len(c["token_ids"]) for c in completions)
        reason = ", ".join(sorted({str(c["finish_reason"]) for c in completions}))
        click.echo(f"({tokens} tokens in {seconds:.2f} s, finished by {reason})", err=True)


def _ragged_ids(text: str) -> list[list[int]]:
    """--prompt-ids for text generation: rows of any lengths."""
    try:
        rows = [[int(tok) for tok in row.split(",") if tok.strip()] for row in text.split(";")]
    except ValueError:
        raise InputError(f"--prompt-ids: expected comma-separated integers (rows separated by ';'), got {text!r}") from None
    if not rows or not all(rows):
        raise InputError("--prompt-ids: every row needs at least one token")
    return rows
