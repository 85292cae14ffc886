"""The `trtbuild` command: parse, call the library, render. The one place errors become `Error: ...`."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from trtbuild.errors import InputError, TrtbuildError

engines_option = click.option("--engines", type=click.Path(file_okay=False), default=None,
                              help="Engine store folder (default: $TRTBUILD_ENGINES, else ~/.cache/trtbuild/engines).")
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress lines (a wait for another build still shows).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
recipe_arg = click.argument("recipe", type=click.Path(dir_okay=False))
remote_option = click.option("--remote", default=None, metavar="s3://BUCKET/PREFIX",
                             help="Object store behind the local store (default: $TRTBUILD_REMOTE; docs/fleet.md).")
# `cache ls/verify/prune --remote`: act on the remote; a bare --remote means $TRTBUILD_REMOTE
remote_target = click.option("--remote", default=None, is_flag=False, flag_value="", metavar="[s3://BUCKET/PREFIX]",
                             help="Act on the remote tier instead (bare: $TRTBUILD_REMOTE).")


class _Main(click.Group):
    """Turns TrtbuildError into `Error: message (hint)` and its exit status; other exceptions are
    bugs and keep their traceback. TRTBUILD_DEBUG=1 shows the traceback of user errors too."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TrtbuildError as exc:
            if os.environ.get("TRTBUILD_DEBUG") == "1":
                raise
            click.echo(f"Error: {exc}", err=True)
            sys.exit(exc.exit_code)


@click.group(cls=_Main)
@click.version_option(package_name="trtbuild")
def main() -> None:
    """Build LLM inference engines from YAML recipes, cache them by key, run them with per-phase timings."""


@contextlib.contextmanager
def _progress(quiet: bool) -> Iterator[Callable[[str], None]]:
    """Build progress on stderr: on a terminal a live line with the phase and the seconds since the build
    started, and each finished phase kept above it; elsewhere one timestamped line a phase. `--quiet` and
    `--json` keep only a wait for another process's build (worth knowing: it can take minutes)."""
    if quiet:
        yield lambda message: click.echo(f"trtbuild: {message}", err=True) if message.startswith("waiting") else None
        return
    import time

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    t0 = time.perf_counter()
    if not console.is_terminal:
        yield lambda message: click.echo(f"trtbuild: [{time.perf_counter() - t0:6.1f} s] {message}", err=True)
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        last: list[str] = []

        def show(message: str) -> None:
            if last:  # the phase that just ended stays on screen with the time it ended at
                console.print(f"[dim]{time.perf_counter() - t0:6.1f} s[/dim]  {last[0]}", highlight=False)
            last[:] = [message]
            bar.update(task, description=message)

        yield show


def _load(path: str) -> Any:
    from trtbuild.recipe import load_recipe

    return load_recipe(path)


@main.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(dir_okay=False))
def validate(recipes: tuple[str, ...]) -> None:
    """Check recipes without building anything; every problem is reported."""
    failed: list[TrtbuildError] = []
    for path in recipes:
        try:
            recipe = _load(path)
        except TrtbuildError as exc:
            failed.append(exc)
            click.echo(f"Error: {exc}", err=True)
        else:
            if recipe.model.kind == "local" and recipe.model.path is not None and recipe.model.path.is_dir():
                try:  # what `run` would refuse in the folder, read from its config and the weights' headers
                    from trtbuild.models.checkpoint import check_folder

                    check_folder(recipe.model.path)
                except TrtbuildError as exc:
                    failed.append(exc)
                    click.echo(f"Error: {path}: model.source: {exc}", err=True)
                    continue
            click.echo(f"{path}: ok ({recipe.name}, backend {recipe.backend}, {recipe.precision})")
    if failed:
        sys.exit(max(e.exit_code for e in failed))


@main.command("build")
@recipe_arg
@engines_option
@click.option("--verify", is_flag=True, help="Hash every file of a cached engine (sizes are always checked).")
@json_option
@quiet_option
@remote_option
def build_cmd(recipe: str, engines: str | None, verify: bool, as_json: bool, quiet: bool, remote: str | None) -> None:
    """Build the recipe's engine, or find it in the store."""
    from trtbuild.builder import build

    r = _load(recipe)
    with _progress(as_json or quiet) as progress:
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
        click.echo(f"  remote {_fleet_line(outcome.fleet)}")
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


@main.command("run")
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
@click.option("--stop", multiple=True, help="A stop string (repeatable; needs the tokenizer); not included in the text.")
@click.option("--iterations", type=int, default=3, show_default=True)
@click.option("--verify", is_flag=True, help="Hash every engine file before loading (sizes are always checked).")
@json_option
@quiet_option
@remote_option
def run_cmd(recipe: str, engines: str | None, no_build: bool, batch_size: int | None, input_len: int | None,
            output_len: int | None, prompt_ids: str | None, prompt_text: str | None, chat_text: str | None,
            temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None,
            stop: tuple[str, ...], iterations: int, verify: bool, as_json: bool, quiet: bool,
            remote: str | None) -> None:
    """Find (or build) the engine, run it, and report every phase. With --chat or a sampling flag (--temperature,
    --top-k, --top-p, --seed, --stop): generate text from the prompt instead, streamed as it comes."""
    from trtbuild.measure.report import print_table
    from trtbuild.runner import check_run_shape, open_session, run_report

    r = _load(recipe)
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
    with _progress(as_json or quiet) as progress:
        session = open_session(r, engines, build=not no_build, progress=progress, verify=verify, remote=remote)
    with session:
        report = run_report(session, **shape, iterations=iterations, prompt_ids=ids, prompt_text=prompt_text)
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
    with _progress(as_json or quiet) as progress:
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


@main.command("serve")
@recipe_arg
@engines_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--no-build", is_flag=True, help="Never build; a missing engine is an error (also TRTBUILD_NO_BUILD=1).")
@click.option("--max-queue", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests that may wait and could not be admitted now; beyond it a request is answered 429 "
                   "with Retry-After.")
@click.option("--kv-cache", type=click.Choice(["auto", "paged", "rows"]), default="auto", show_default=True,
              help="paged: a block pool (needs an engine built with options.kv_cache paged); rows: a full-length "
                   "row a request; auto: paged where the engine can.")
@click.option("--kv-memory", type=click.FloatRange(0.01, 1.0), default=0.9, show_default=True,
              help="The fraction of the memory left after the weights that the paged pool takes.")
@click.option("--kv-blocks", type=click.IntRange(min=1), default=None, help="The paged pool's blocks (overrides --kv-memory).")
@click.option("--prefill-chunk", type=click.IntRange(min=0), default=512, show_default=True,
              help="Prompt tokens prefilled a step beside the decode rows (paged); 0: each prompt whole.")
@click.option("--no-prefix-cache", is_flag=True, help="Do not share the KV blocks of common prompt prefixes (paged).")
@quiet_option
@remote_option
def serve_cmd(recipe: str, engines: str | None, host: str, port: int, no_build: bool, max_queue: int, kv_cache: str,
              kv_memory: float, kv_blocks: int | None, prefill_chunk: int, no_prefix_cache: bool,
              quiet: bool, remote: str | None) -> None:
    """Serve the recipe's engine over an OpenAI-compatible HTTP API, with continuous batching."""
    from trtbuild.runner import open_session
    from trtbuild.serving.server import KvSettings, require, serve

    require()  # before a build of minutes, not after
    r = _load(recipe)
    with _progress(quiet) as progress:
        session = open_session(r, engines, build=not no_build, progress=progress, remote=remote)
    kv = KvSettings(kv_cache, kv_memory, kv_blocks, prefill_chunk, not no_prefix_cache)
    serve(session, host=host, port=port, max_queue=max_queue, log_level="warning" if quiet else "info", kv=kv)


@main.command("profile")
@recipe_arg
@engines_option
@click.option("--phase", type=click.Choice(["decode", "prefill", "both"]), default="both", show_default=True)
@click.option("--batch-size", type=int, default=None, help="Rows (default: the recipe's run.batch_size).")
@click.option("--input-len", type=int, default=None, help="Prompt tokens (default: the recipe's run.input_len).")
@click.option("--plot", "plot_path", default=None, help="Also write a PNG: roofline and where the step's time goes.")
@json_option
def profile_cmd(recipe: str, engines: str | None, phase: str, batch_size: int | None, input_len: int | None,
                plot_path: str | None, as_json: bool) -> None:
    """Which kernel is slow, and why: each call site's time, bytes, FLOPs and roofline verdict."""
    from trtbuild.measure.ceilings import cached
    from trtbuild.measure.profile import check_shape, profile_engine
    from trtbuild.measure.profile_report import check_plot_path, plot, print_profile
    from trtbuild.runner import open_session
    from trtbuild.store.local import Store

    r = _load(recipe)
    b = r.run.batch_size if batch_size is None else batch_size
    t = r.run.input_len if input_len is None else input_len
    check_shape(r.shapes, b, t)  # before the engine loads, as for `run`
    if plot_path is not None:
        check_plot_path(plot_path)
    with _progress(as_json) as progress:
        session = open_session(r, engines, progress=progress)
    phases = ("prefill", "decode") if phase == "both" else (phase,)
    with session:
        # the roofs, measured once a device and kept beside the engines
        ceilings = cached(session.engine.device, Store(engines).root / "ceilings")
        result = profile_engine(session, phases, b, t, ceilings)
    if plot_path is not None:
        plot(result, plot_path)
        result["plot"] = plot_path
    if as_json:
        click.echo(json.dumps(result))
    else:
        print_profile(result)
        if plot_path is not None:
            click.echo(f"plot: {plot_path}")


@main.group()
def cache() -> None:
    """Inspect and manage the engine store."""


def _when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@cache.command("ls")
@engines_option
@json_option
@remote_target
def cache_ls(engines: str | None, as_json: bool, remote: str | None) -> None:
    """List engines: name, backend, precision, size, created, last used, key prefix."""
    from trtbuild.store.local import Store

    if remote is not None:
        return _remote_ls(remote, as_json)

    store = Store(engines)
    entries = store.entries()
    rows: list[dict[str, Any]] = [
        {"name": e.name, "backend": e.manifest.get("backend"), "precision": e.manifest.get("precision"),
         "size": e.size(), "created": e.manifest.get("created"), "last_used": e.manifest.get("last_used"),
         "pinned": store.is_pinned(e.key), "key": e.key, "path": str(e.path)} for e in entries]
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no engines")
        return
    click.echo(f"{'NAME':<24} {'BACKEND':<13} {'PREC':<6} {'SIZE':>9}  {'CREATED':<16}  {'LAST USED':<16}  "
               f"{'PINNED':<6}  KEY")
    for r in rows:
        click.echo(f"{r['name']:<24} {r['backend']:<13} {r['precision']:<6} {_size(r['size']):>9}  "
                   f"{_when(r['created']):<16}  {_when(r['last_used']):<16}  {'yes' if r['pinned'] else '-':<6}  "
                   f"{r['key'][:16]}")


@cache.command("show")
@click.argument("ref")
@engines_option
@json_option
def cache_show(ref: str, engines: str | None, as_json: bool) -> None:
    """One entry, by key prefix (6+ characters), name or path: a summary, or its whole manifest with --json."""
    from trtbuild.store.local import Store

    store = Store(engines)
    entry = store.find(ref)
    m = entry.manifest
    if as_json:
        click.echo(json.dumps(m, indent=2, sort_keys=True))
        return
    recipe = m.get("key_material", {}).get("recipe", {})
    device = m.get("key_material", {}).get("device", {})
    toolchain = m.get("key_material", {}).get("backend", {}).get("toolchain", {})
    build = m.get("build", {})
    lines = [f"{entry.path.name}",
             f"  key        {entry.key}",
             f"  path       {entry.path}",
             f"  recipe     {m.get('name')} ({m.get('recipe_file') or '-'}), backend {m.get('backend')}, "
             f"precision {m.get('precision')}",
             f"  model      {m.get('model_source')}",
             f"  shapes     {json.dumps(recipe.get('shapes', {}), sort_keys=True)}",
             f"  device     {device.get('name', device.get('kind', '-'))}",
             f"  toolchain  {', '.join(f'{k} {v}' for k, v in sorted(toolchain.items()))}",
             f"  size       {_size(entry.size())} in {len(m.get('files', {}))} files"
             f"{' (pinned)' if store.is_pinned(entry.key) else ''}",
             f"  built      {_when(m.get('created'))} in {float(build.get('total_s') or 0):.1f} s on "
             f"{build.get('host', {}).get('hostname', '-') if isinstance(build.get('host'), dict) else '-'}",
             f"  last used  {_when(m.get('last_used'))}"]
    for name, seconds in (build.get("phases") or {}).items():
        lines.append(f"    {name:<18} {seconds:8.2f} s")
    lines.append("  (--json for the whole manifest: key material, files and hashes, tactics)")
    click.echo("\n".join(lines))


@cache.command("rm")
@click.argument("refs", nargs=-1, required=True)
@engines_option
@click.option("--force", is_flag=True, help="Remove even entries that a running process has open.")
def cache_rm(refs: tuple[str, ...], engines: str | None, force: bool) -> None:
    """Remove entries (their tactic caches stay)."""
    from trtbuild.store.local import Store

    store = Store(engines)
    for ref in refs:
        entry = store.find(ref)
        if store.is_in_use(entry.key) and not force:
            raise TrtbuildError(f"{entry.path.name} is open in a running process", hint="stop it, or pass --force")
        store.remove(entry)
        click.echo(f"removed {entry.path.name}")


def _set_pin(ref: str, engines: str | None, pinned: bool) -> None:
    from trtbuild.store.local import Store

    store = Store(engines)
    entry = store.find(ref)
    store.pin(entry, pinned=pinned)
    click.echo(f"{'pinned' if pinned else 'unpinned'} {entry.path.name}")


@cache.command("pin")
@click.argument("ref")
@engines_option
def cache_pin(ref: str, engines: str | None) -> None:
    """Protect an entry from prune."""
    _set_pin(ref, engines, True)


@cache.command("unpin")
@click.argument("ref")
@engines_option
def cache_unpin(ref: str, engines: str | None) -> None:
    """Let prune remove an entry again."""
    _set_pin(ref, engines, False)


@cache.command("prune")
@engines_option
@click.option("--max-size", default=None, help="Keep the store under this size, e.g. 50G (LRU first).")
@click.option("--older-than", default=None, help="Remove entries unused for this long, e.g. 30d.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@remote_target
def cache_prune(engines: str | None, max_size: str | None, older_than: str | None, dry_run: bool,
                remote: str | None) -> None:
    """Remove quarantined entries (oldest first), then least recently used ones; pinned and in-use entries stay."""
    from trtbuild.store.housekeeping import parse_age, parse_size, plan_prune
    from trtbuild.store.local import Store

    if max_size is None and older_than is None:
        raise InputError("cache prune: give --max-size and/or --older-than")
    if remote is not None:
        return _remote_prune(remote, parse_size(max_size) if max_size else None,
                             parse_age(older_than) if older_than else None, dry_run)
    store = Store(engines)
    plan = plan_prune(store, parse_size(max_size) if max_size else None, parse_age(older_than) if older_than else None)
    verb = "would remove" if dry_run else "removed"
    for path, size, when in plan.remove_quarantined:
        if not dry_run:
            store.remove_quarantined(path)
        click.echo(f"{verb} quarantine/{path.name} ({_size(size)}, quarantined {_when(when)})")
    for entry in plan.remove:
        if not dry_run:
            store.remove(entry)
        click.echo(f"{verb} {entry.path.name} ({_size(entry.size())}, last used {_when(entry.manifest.get('last_used'))})")
    for entry in plan.kept_pinned:
        click.echo(f"kept   {entry.path.name} (pinned)")
    for entry in plan.kept_in_use:
        click.echo(f"kept   {entry.path.name} (in use)")
    click.echo(f"store: {_size(plan.size_before)} -> {_size(plan.size_after)}")


@cache.command("explain")
@recipe_arg
@engines_option
@json_option
def cache_explain(recipe: str, engines: str | None, as_json: bool) -> None:
    """Hit (exit 0) or miss (exit 1) for a recipe; on a miss, the key fields that differ from the nearest entry."""
    from trtbuild.builder import explain

    result = explain(_load(recipe), engines)
    if as_json:
        click.echo(json.dumps(result))
    elif result["hit"]:
        click.echo(f"hit: {result['entry']} (key {result['key'][:16]})")
    elif result["nearest"] is None:
        click.echo(f"miss: key {result['key'][:16]}; the store has no entries to compare with")
    else:
        click.echo(f"miss: key {result['key'][:16]}; nearest entry {result['nearest']} differs in:")
        for d in result["differences"]:
            click.echo(f"  {d['field']}: entry {json.dumps(d['entry'])} -> recipe {json.dumps(d['recipe'])}")
    sys.exit(0 if result["hit"] else 1)  # scripts ask "is it built?" with the exit status


@cache.command("stats")
@engines_option
@json_option
def cache_stats(engines: str | None, as_json: bool) -> None:
    """Hits, misses, builds, the build seconds that hits saved, and what the store and its quarantine hold."""
    from trtbuild.store.housekeeping import stats
    from trtbuild.store.local import Store

    counts = stats(Store(engines))
    if as_json:
        click.echo(json.dumps(counts))
        return
    click.echo(f"hits {counts['hits']}  misses {counts['misses']}  builds {counts['builds']}  "
               f"build time {counts['build_s']:.1f} s  saved by hits {counts['build_s_saved']:.1f} s")
    click.echo(f"entries {counts['entries']} ({_size(counts['entries_bytes'])})  quarantined {counts['quarantined']} "
               f"({_size(counts['quarantine_bytes'])}; `trtbuild cache prune` removes them first)")


@cache.command("verify")
@click.argument("refs", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Verify every entry.")
@engines_option
@remote_target
def cache_verify(refs: tuple[str, ...], all_: bool, engines: str | None, remote: str | None) -> None:
    """Check every file's size and sha256 against the manifest; corrupt entries are quarantined."""
    from trtbuild.store.local import Store, verify

    store = Store(engines)
    if not refs and not all_:
        raise InputError("cache verify: name entries or pass --all")
    if remote is not None:
        return _remote_verify(remote, refs, all_)
    entries = store.entries() if all_ else [store.find(r) for r in refs]
    bad = 0
    for entry in entries:
        problems = verify(entry, full=True)
        if problems:
            bad += 1
            dest = store.quarantine(entry.path, "; ".join(problems))
            click.echo(f"CORRUPT {entry.path.name}: {'; '.join(problems)} (moved to {dest})")
        else:
            click.echo(f"ok      {entry.path.name}")
    if bad:
        sys.exit(1)


@main.command()
def doctor() -> None:
    """Which backends work here, why not, and this machine's device and toolchain."""
    from trtbuild import backends
    from trtbuild.store import fingerprint
    from trtbuild.store.local import Store

    missing = _missing_dependencies()
    for dist, problem in missing:
        click.echo(f"dependency {dist}: {problem}")
    click.echo(f"dependencies: {'ok' if not missing else f'{len(missing)} missing (pip install trtbuild again)'}")
    store = Store()
    click.echo(f"store: {store.root} ({store.origin})")
    click.echo(f"remote: {_doctor_remote(store)}")
    for name in backends.REGISTRY:
        ok, reason = backends.availability(name)
        click.echo(f"{name:<13} {'available' if ok else 'unavailable'}: {reason}")
    click.echo(f"device: {json.dumps(fingerprint.device())}")
    click.echo(f"host:   {json.dumps(fingerprint.host())}")
    from trtbuild.backends.torch import cxx

    # What compiled torch graphs depend on (the H200 image crashed every graph here until it was fixed).
    shadows = cxx.shadowing_libraries()
    state = (f"served by {', '.join(sorted(set(shadows.values())))} first: compiled graphs will be refused"
             if shadows else "first in the global scope")
    click.echo(f"c++:    compiler {cxx.compiler().path} ({cxx.compiler().version}); "
               f"libstdc++ {cxx.loaded_libstdcxx() or 'not loaded'}, {state}")
    if missing:
        sys.exit(1)


def _missing_dependencies() -> list[tuple[str, str]]:
    """Every runtime dependency that this installation declares (its metadata, so the list cannot go stale),
    imported: (distribution, problem) for each that is absent or fails to import."""
    import importlib
    import re
    from importlib import metadata

    try:
        requires = metadata.requires("trtbuild") or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return [("trtbuild", "not installed (pip install -e .)")]
    modules: dict[str, list[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            modules.setdefault(_normalize(dist), []).append(module)
    problems = []
    for req in requires:
        if "extra ==" in req:
            continue
        dist = _normalize(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])
        names = [m for m in modules.get(dist, []) if not m.startswith("_")]
        if not names:
            problems.append((dist, "not installed"))
            continue
        for module in names[:1]:
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - any failure to import is what doctor reports
                problems.append((dist, f"installed but `import {module}` fails: {exc}"))
    return problems


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# -- the remote tier (store/remote.py, store/fleet.py): cache push/pull, and the remote side of cache ls/verify/prune and doctor -------
def _open_remote(url: str | None) -> Any:
    from trtbuild.store.remote import ENV_URL, Remote, configured_url

    chosen = configured_url(url or None)
    if chosen is None:
        raise InputError(f"no remote: pass --remote s3://BUCKET/PREFIX or set {ENV_URL}")
    return Remote(chosen)


def _fleet_line(fleet: dict[str, Any]) -> str:
    what = {"remote": f"pulled in {fleet.get('pull_s', 0.0):.2f} s", "built": f"pushed in {fleet.get('push_s', 0.0):.2f} s",
            "local": "not needed (local hit)"}.get(fleet.get("tier", "local"), "")
    return f"{fleet['url']}: {what}" + (f"; {fleet['warning']}" if fleet.get("warning") else "")


@cache.command("push")
@click.argument("ref", required=False)
@engines_option
@remote_option
@click.option("--tactics", is_flag=True, help="Push the tactic caches too (alone when no REF is given).")
def cache_push(ref: str | None, engines: str | None, remote: str | None, tactics: bool) -> None:
    """Upload an entry (every file hashed first) and, with --tactics, the tactic caches, to the remote tier."""
    from trtbuild.store.fleet import push_tactics
    from trtbuild.store.local import Store, verify

    if ref is None and not tactics:
        raise InputError("cache push: name an entry, or pass --tactics")
    store, rem = Store(engines), _open_remote(remote)
    if ref is not None:
        entry = store.find(ref)
        if problems := verify(entry, full=True):  # never spread a damaged entry to the fleet
            raise TrtbuildError(f"{entry.path.name} is corrupt here ({'; '.join(problems)}); not pushed",
                                hint=f"`trtbuild cache verify {entry.key[:12]}` moves it to quarantine")
        with _progress(False) as progress:
            pushed = rem.push(entry, progress)
        click.echo(f"{'pushed' if pushed else 'already on the remote:'} {entry.path.name} -> {rem.url}")
    if tactics:
        click.echo(f"tactics: {push_tactics(rem, store)} file(s) pushed to {rem.url}")


@cache.command("pull")
@click.argument("ref", required=False)
@engines_option
@remote_option
@click.option("--tactics", is_flag=True, help="Pull the tactic caches too (alone when no REF is given).")
def cache_pull(ref: str | None, engines: str | None, remote: str | None, tactics: bool) -> None:
    """Download an entry (REF: a remote entry's name or key prefix, or a recipe file, whose key is computed
    here) into the local store, every file's sha256 checked; never builds."""
    from pathlib import Path

    from trtbuild.store.fleet import pull_tactics
    from trtbuild.store.local import Store

    if ref is None and not tactics:
        raise InputError("cache pull: name an entry or a recipe, or pass --tactics")
    store, rem = Store(engines), _open_remote(remote)
    if ref is not None and Path(ref).is_file():
        from trtbuild.builder import build

        with _progress(False) as progress:
            outcome = build(_load(ref), engines, allow_build=False, progress=progress, remote=rem.url)
        how = "pulled" if outcome.fleet.get("tier") == "remote" else "already here:"
        click.echo(f"{how} {outcome.entry.path.name} ({_fleet_line(outcome.fleet)})" if how == "pulled"
                   else f"{how} {outcome.entry.path}")
    elif ref is not None:
        manifest = rem.find(ref)
        if (entry := store.lookup(manifest["key"])) is not None:
            click.echo(f"already here: {entry.path}")
        else:
            with _progress(False) as progress:
                entry = rem.pull(store, manifest["key"], progress)
            click.echo(f"pulled {entry.path.name} from {rem.url}")
    if tactics:
        click.echo(f"tactics: {pull_tactics(rem, store)} file(s) pulled from {rem.url}")


def _remote_ls(url: str, as_json: bool) -> None:
    rem = _open_remote(url)
    rows = [{"name": m["name"], "backend": m.get("backend"), "precision": m.get("precision"),
             "size": sum(int(f["size"]) for f in m["files"].values()), "created": m.get("created"),
             "pushed_by": m.get("remote", {}).get("host"), "key": m["key"]} for m in rem.entries()]
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo(f"no engines on {rem.url}")
        return
    click.echo(f"{'NAME':<24} {'BACKEND':<13} {'PREC':<6} {'SIZE':>9}  {'CREATED':<16}  {'PUSHED BY':<20}  KEY")
    for r in rows:
        click.echo(f"{r['name']:<24} {r['backend'] or '-':<13} {r['precision'] or '-':<6} {_size(r['size']):>9}  "
                   f"{_when(r['created']):<16}  {str(r['pushed_by'] or '-'):<20}  {r['key'][:16]}")


def _remote_verify(url: str, refs: tuple[str, ...], all_: bool) -> None:
    rem = _open_remote(url)
    bad = 0
    for m in rem.entries() if all_ else [rem.find(r) for r in refs]:
        label = f"{m['name']}-{m['key'][:16]}"
        if problems := rem.verify(m["key"]):
            bad += 1
            rem.quarantine(m["key"], "; ".join(problems))
            click.echo(f"CORRUPT {label}: {'; '.join(problems)} (moved to quarantine on {rem.url})")
        else:
            click.echo(f"ok      {label}")
    if bad:
        sys.exit(1)


def _remote_prune(url: str, max_size: int | None, older_than: float | None, dry_run: bool) -> None:
    from trtbuild.store.fleet import plan_prune

    rem = _open_remote(url)
    plan = plan_prune(rem, max_size, older_than)
    verb = "would remove" if dry_run else "removed"
    for m in plan.remove:
        if not dry_run:
            rem.remove(m["key"])
        click.echo(f"{verb} {m['name']}-{m['key'][:16]} from {rem.url}")
    for prefix in plan.orphans:
        if not dry_run:
            rem.remove_prefix(prefix)
        click.echo(f"{verb} {prefix} (a push that never wrote its manifest)")
    for m, why in plan.kept:
        click.echo(f"kept   {m['name']}-{m['key'][:16]} ({why})")
    click.echo(f"remote: {_size(plan.size_before)} -> {_size(plan.size_after)}")


@main.command("eval")
@recipe_arg
@click.option("--text", "text_file", required=True, type=click.Path(dir_okay=False),
              help="A text file (UTF-8); its perplexity is measured in windows of the engine's max_seq_len.")
@click.option("--against", default=None, type=click.Path(dir_okay=False),
              help="Another recipe: greedy-token agreement with its engine on prompts from the text, and the "
                   "largest logit difference.")
@engines_option
@click.option("--no-build", is_flag=True, help="Never build; a missing engine is an error.")
@json_option
@quiet_option
def eval_cmd(recipe: str, text_file: str, against: str | None, engines: str | None, no_build: bool,
             as_json: bool, quiet: bool) -> None:
    """Quality of an engine: perplexity over a text, and agreement with another engine (docs/quantization.md)."""
    from pathlib import Path

    from trtbuild.measure.evaluate import evaluate

    r, other = _load(recipe), (_load(against) if against else None)
    if not Path(text_file).is_file():
        raise InputError(f"{text_file}: --text: file not found")
    with _progress(as_json or quiet) as progress:
        result = evaluate(r, Path(text_file), engines, other, build=not no_build, progress=progress)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"{result['recipe']} ({result['precision']}): perplexity {result['perplexity']:.4f} over "
               f"{result['tokens_scored']} tokens of {result['text']} ({result['windows']} windows of "
               f"{result['window']}, tokens from {result['tokens_from']})")
    if "against" in result:
        a = result["against"]
        click.echo(f"against {a['recipe']} ({a['precision']}): greedy tokens agree {a['greedy_agreement']:.1%} "
                   f"({a['prompts']} prompts of {a['prompt_len']}, {a['new_tokens']} new tokens each); "
                   f"teacher-forced {a['teacher_forced_agreement']:.1%}; largest logit difference "
                   f"{a['max_logit_diff']:.4f}")


def _doctor_remote(store: Any) -> str:
    """The remote tier: configured or not, reachable or why not, and the last pull this store made."""
    from trtbuild.store.remote import ENV_URL, Remote, configured_url

    url = configured_url(None)
    if url is None:
        return f"not configured ({ENV_URL} or --remote)"
    try:
        state = f"{url}: reachable, {len(Remote(url).keys())} entries"
    except TrtbuildError as exc:
        state = f"{url}: {exc}"
    pulls = []
    with contextlib.suppress(OSError, ValueError):
        pulls = [e for line in store.stats_file.read_text().splitlines() if (e := json.loads(line)).get("event") == "pull"]
    if pulls:
        state += (f"; last pull: {pulls[-1].get('name')} in {pulls[-1].get('pull_s', 0.0):.2f} s "
                  f"({_when(pulls[-1].get('time'))})")
    return state
