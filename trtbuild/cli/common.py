"""What every command shares: the options, build progress on stderr, reading a recipe, the store's figures in
words, the remote tier opened."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

import click

from trtbuild.errors import InputError


engines_option = click.option("--engines", type=click.Path(file_okay=False), default=None,
                              help="Engine store folder (default: $TRTBUILD_ENGINES, else ~/.cache/trtbuild/engines).")
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress lines (a wait for another build still shows).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
recipe_arg = click.argument("recipe", type=click.Path(dir_okay=False))
threads_option = click.option("--threads", type=click.IntRange(min=1), default=None,
                              help="CPU threads for torch (default: the cores free now, said in the report).")
remote_option = click.option("--remote", default=None, metavar="s3://BUCKET/PREFIX",
                             help="Object store behind the local store (default: $TRTBUILD_REMOTE; docs/fleet.md).")
# `cache ls/verify/prune --remote`: act on the remote; a bare --remote means $TRTBUILD_REMOTE
remote_target = click.option("--remote", default=None, is_flag=False, flag_value="", metavar="[s3://BUCKET/PREFIX]",
                             help="Act on the remote tier instead (bare: $TRTBUILD_REMOTE).")


@contextlib.contextmanager
def build_progress(quiet: bool) -> Iterator[Callable[[str], None]]:
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


def load_recipe_file(path: str) -> Any:
    from trtbuild.recipe import load_recipe

    return load_recipe(path)


def human_time(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M") if ts else "-"


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# -- the remote tier (store/remote.py, store/fleet.py): for cache push/pull, cache ls/verify/prune --remote, build
def open_remote(url: str | None) -> Any:
    from trtbuild.store.remote import ENV_URL, Remote, configured_url

    chosen = configured_url(url or None)
    if chosen is None:
        raise InputError(f"no remote: pass --remote s3://BUCKET/PREFIX or set {ENV_URL}")
    return Remote(chosen)


def fleet_line(fleet: dict[str, Any]) -> str:
    what = {"remote": f"pulled in {fleet.get('pull_s', 0.0):.2f} s", "built": f"pushed in {fleet.get('push_s', 0.0):.2f} s",
            "local": "not needed (local hit)"}.get(fleet.get("tier", "local"), "")
    return f"{fleet['url']}: {what}" + (f"; {fleet['warning']}" if fleet.get("warning") else "")
