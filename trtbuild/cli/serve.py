"""`trtbuild serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import click

from trtbuild.cli.common import (build_progress, engines_option, load_recipe_file, quiet_option, recipe_arg,
                                 remote_option, threads_option)


@click.command("serve")
@recipe_arg
@engines_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--no-build", is_flag=True, help="Never build; a missing engine is an error (also TRTBUILD_NO_BUILD=1).")
@click.option("--max-queue", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests that may wait for a row; beyond it a request is answered 429 with Retry-After.")
@threads_option
@quiet_option
@remote_option
def serve_cmd(recipe: str, engines: str | None, host: str, port: int, no_build: bool, max_queue: int,
              threads: int | None, quiet: bool, remote: str | None) -> None:
    """Serve the recipe's engine over an OpenAI-compatible HTTP API, with continuous batching."""
    from trtbuild.runner import open_session
    from trtbuild.serving.server import require, serve
    from trtbuild.timing import use_threads

    require()  # before a build of minutes, not after
    r = load_recipe_file(recipe)
    used = use_threads(threads)
    if not quiet:
        click.echo(f"trtbuild: {used['threads']} thread(s) ({used['why']})", err=True)
    with build_progress(quiet) as progress:
        session = open_session(r, engines, build=not no_build, progress=progress, remote=remote)
    serve(session, host=host, port=port, max_queue=max_queue, log_level="warning" if quiet else "info")
