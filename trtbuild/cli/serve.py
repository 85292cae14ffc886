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
@click.option("--no-mixed-step", is_flag=True,
              help="Run a step's prompt chunks and decode rows as two calls, not one (paged).")
@click.option("--no-overlap", is_flag=True,
              help="Read each step's tokens back before launching the next (paged; by default the host delivers a "
                   "step's tokens while the device runs the next).")
@click.option("--captured-chunks", is_flag=True,
              help="Replay a step's prompt chunks from their captured CUDA graphs beside the decode rows' graph, "
                   "planned to the graphs' shapes, instead of one uncaptured call of the mixed step (paged).")
@click.option("--prefill-order", type=click.Choice(["arrival", "shortest"]), default="shortest", show_default=True,
              help="Which prompts a step prefills first (paged): in admission order, or the fewest tokens left first "
                   "(a request waiting a second or more keeps its place).")
@click.option("--no-captured-mixed", is_flag=True,
              help="Call the mixed step directly every step, not from its captured CUDA graphs (paged, CUDA).")
@threads_option
@quiet_option
@remote_option
def serve_cmd(recipe: str, engines: str | None, host: str, port: int, no_build: bool, max_queue: int, kv_cache: str,
              kv_memory: float, kv_blocks: int | None, prefill_chunk: int, no_prefix_cache: bool, no_mixed_step: bool,
              no_overlap: bool, captured_chunks: bool, prefill_order: str, no_captured_mixed: bool,
              threads: int | None, quiet: bool, remote: str | None) -> None:
    """Serve the recipe's engine over an OpenAI-compatible HTTP API, with continuous batching."""
    from trtbuild.runner import open_session
    from trtbuild.serving.server import KvSettings, require, serve
    from trtbuild.timing import use_threads

    require()  # before a build of minutes, not after
    r = load_recipe_file(recipe)
    used = use_threads(threads)
    if not quiet:
        click.echo(f"trtbuild: {used['threads']} thread(s) ({used['why']})", err=True)
    with build_progress(quiet) as progress:
        session = open_session(r, engines, build=not no_build, progress=progress, remote=remote)
    kv = KvSettings(kv_cache, kv_memory, kv_blocks, prefill_chunk, not no_prefix_cache, not no_mixed_step,
                    not no_overlap, captured_chunks, not no_captured_mixed, prefill_order)
    serve(session, host=host, port=port, max_queue=max_queue, log_level="warning" if quiet else "info", kv=kv)
