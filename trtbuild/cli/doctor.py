"""`trtbuild validate` and `trtbuild doctor`: recipes and model folders checked, and what works on this machine."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import click

from trtbuild.cli.common import human_time, load_recipe_file
from trtbuild.errors import TrtbuildError


@click.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(dir_okay=False))
def validate(recipes: tuple[str, ...]) -> None:
    """Check recipes without building anything; every problem is reported."""
    failed: list[TrtbuildError] = []
    for path in recipes:
        try:
            recipe = load_recipe_file(path)
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


@click.command()
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
                  f"({human_time(pulls[-1].get('time'))})")
    return state
