"""The `trtbuild` command: parse, call the library, render. The one place errors become `Error: ...`.

One module a command group: `run` (build, run), `cache`, `serve`, `measure` (eval, profile), `doctor`
(validate, doctor); `common` holds what they share."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

import click

from trtbuild.cli.cache import cache
from trtbuild.cli.doctor import doctor, validate
from trtbuild.cli.measure import eval_cmd, profile_cmd
from trtbuild.cli.run import build_cmd, run_cmd
from trtbuild.cli.serve import serve_cmd
from trtbuild.errors import TrtbuildError


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


for _command in (validate, build_cmd, run_cmd, serve_cmd, profile_cmd, cache, doctor, eval_cmd):
    main.add_command(_command)


def entry() -> None:
    """The process's entry point (the `trtbuild` script, `python -m trtbuild`): the command, then the end.

    Once torch is imported, the interpreter's own teardown of its modules takes 1.0-1.6 s after the work is done
    (a tiny-llama build printed its report 1.6 s before its process ended; importing Inductor alone costs 1.0 s
    at exit), time every build and run paid. Where torch is loaded and no other thread is still working, the
    exit handlers run (logging, multiprocessing's children, weakref finalizers), the output is flushed, and
    the process ends there. `main` itself, which tests call in-process, exits as any click command does."""
    try:
        main()
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    if isinstance(code, str):  # sys.exit("message"): what the interpreter would print, and status 1
        print(code, file=sys.stderr)
        code = 1
    status = int(code or 0)
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if "torch" not in sys.modules or others:
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    os._exit(status)


__all__ = ["main", "entry"]
