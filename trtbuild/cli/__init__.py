"""The `trtbuild` command: parse, call the library, render. The one place errors become `Error: ...`.

One module a command group: `run` (build, run), `cache`, `serve`, `measure` (eval, profile), `doctor`
(validate, doctor); `common` holds what they share."""

from __future__ import annotations

import os
import sys
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

__all__ = ["main"]
