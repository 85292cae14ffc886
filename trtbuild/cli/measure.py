"""`trtbuild eval` and `trtbuild profile`: an engine's quality, and where its step's time goes."""

from __future__ import annotations

import json

import click

from trtbuild.cli.common import (build_progress, engines_option, json_option, load_recipe_file, quiet_option,
                                 recipe_arg, threads_option)
from trtbuild.errors import InputError


@click.command("eval")
@recipe_arg
@click.option("--text", "text_file", required=True, type=click.Path(dir_okay=False),
              help="A text file (UTF-8); its perplexity is measured in windows of the engine's max_seq_len.")
@click.option("--stride", type=click.IntRange(min=1), default=None,
              help="Tokens between the starts of two windows (default half a window); each token is scored once.")
@click.option("--eager", is_flag=True, help="Score with the eager model over the engine's weights (CPU) instead of "
                                            "the engine's compiled scoring graph: a cross-check.")
@click.option("--against", default=None, type=click.Path(dir_okay=False),
              help="Another recipe: greedy-token agreement with its engine on prompts from the text, and the "
                   "largest logit difference.")
@engines_option
@click.option("--no-build", is_flag=True, help="Never build; a missing engine is an error.")
@threads_option
@json_option
@quiet_option
def eval_cmd(recipe: str, text_file: str, stride: int | None, eager: bool, against: str | None, engines: str | None,
             no_build: bool, threads: int | None, as_json: bool, quiet: bool) -> None:
    """Quality of an engine: perplexity over a text, and agreement with another engine (docs/quantization.md)."""
    from pathlib import Path

    from trtbuild.measure.evaluate import evaluate
    from trtbuild.timing import use_threads

    r, other = load_recipe_file(recipe), (load_recipe_file(against) if against else None)
    threads_used = use_threads(threads)
    if not Path(text_file).is_file():
        raise InputError(f"{text_file}: --text: file not found")
    with build_progress(as_json or quiet) as progress:
        result = evaluate(r, Path(text_file), engines, other, build=not no_build, progress=progress, stride=stride,
                          eager=eager)
    result["threads"] = threads_used
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"{result['recipe']} ({result['precision']}): perplexity {result['perplexity']:.4f} over "
               f"{result['tokens_scored']} tokens of {result['text']} ({result['windows']} windows of at most "
               f"{result['window']}, {result['stride']} apart; tokens from {result['tokens_from']}; scored by "
               f"{result['scored_by']}; {threads_used['threads']} thread(s))")
    if "against" in result:
        a = result["against"]
        click.echo(f"against {a['recipe']} ({a['precision']}): greedy tokens agree {a['greedy_agreement']:.1%} "
                   f"({a['prompts']} prompts of {a['prompt_len']}, {a['new_tokens']} new tokens each); "
                   f"teacher-forced {a['teacher_forced_agreement']:.1%}; largest logit difference "
                   f"{a['max_logit_diff']:.4f}")


@click.command("profile")
@recipe_arg
@engines_option
@click.option("--phase", type=click.Choice(["decode", "prefill", "both"]), default="both", show_default=True)
@click.option("--batch-size", type=int, default=None, help="Rows (default: the recipe's run.batch_size).")
@click.option("--input-len", type=int, default=None, help="Prompt tokens (default: the recipe's run.input_len).")
@click.option("--plot", "plot_path", default=None, help="Also write a PNG: roofline and where the step's time goes.")
@click.option("--remeasure", is_flag=True, help="Measure the device's roofs again (they are kept from the first "
                                                "profile; the report says how old they are).")
@threads_option
@json_option
def profile_cmd(recipe: str, engines: str | None, phase: str, batch_size: int | None, input_len: int | None,
                plot_path: str | None, remeasure: bool, threads: int | None, as_json: bool) -> None:
    """Which kernel is slow, and why: each call site's time, bytes, FLOPs and roofline verdict."""
    from trtbuild.measure.ceilings import cached, implausible
    from trtbuild.measure.profile import check_shape, profile_engine
    from trtbuild.measure.profile_report import check_plot_path, plot, print_profile
    from trtbuild.runner import open_session
    from trtbuild.store.local import Store
    from trtbuild.timing import use_threads

    r = load_recipe_file(recipe)
    threads_used = use_threads(threads)
    b = r.run.batch_size if batch_size is None else batch_size
    t = r.run.input_len if input_len is None else input_len
    check_shape(r.shapes, b, t)  # before the engine loads, as for `run`
    if plot_path is not None:
        check_plot_path(plot_path)
    with build_progress(as_json) as progress:
        session = open_session(r, engines, progress=progress)
    phases = ("prefill", "decode") if phase == "both" else (phase,)
    with session:
        # the roofs, measured once a device and kept beside the engines
        folder = Store(engines).root / "ceilings"
        ceilings = cached(session.engine.device, folder, fresh=remeasure)
        result = profile_engine(session, phases, b, t, ceilings)
        if not remeasure and (faster := implausible(result)):
            # a site above its roof: the kept roofs were measured on a busier machine; measure and profile again
            ceilings = cached(session.engine.device, folder, fresh=True)
            result = profile_engine(session, phases, b, t, ceilings)
            result["ceilings"]["source"] += (f" (the kept roofs were below what {', '.join(faster[:3])} reached)")
    result["threads"] = threads_used
    if plot_path is not None:
        plot(result, plot_path)
        result["plot"] = plot_path
    if as_json:
        click.echo(json.dumps(result))
    else:
        print_profile(result)
        if plot_path is not None:
            click.echo(f"plot: {plot_path}")
