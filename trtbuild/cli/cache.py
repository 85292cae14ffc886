"""`trtbuild cache ...`: the engine store and its remote tier, listed, explained, counted, verified, pruned and
moved."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from trtbuild.cli.common import (build_progress, engines_option, fleet_line, human_size, human_time, json_option,
                                 load_recipe_file, open_remote, recipe_arg, remote_option, remote_target)
from trtbuild.errors import InputError, TrtbuildError


@click.group()
def cache() -> None:
    """Inspect and manage the engine store."""


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
        click.echo(f"{r['name']:<24} {r['backend']:<13} {r['precision']:<6} {human_size(r['size']):>9}  "
                   f"{human_time(r['created']):<16}  {human_time(r['last_used']):<16}  {'yes' if r['pinned'] else '-':<6}  "
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
             f"  size       {human_size(entry.size())} in {len(m.get('files', {}))} files"
             f"{' (pinned)' if store.is_pinned(entry.key) else ''}",
             f"  built      {human_time(m.get('created'))} in {float(build.get('total_s') or 0):.1f} s on "
             f"{build.get('host', {}).get('hostname', '-') if isinstance(build.get('host'), dict) else '-'}",
             f"  last used  {human_time(m.get('last_used'))}"]
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
@click.option("--quarantine", "quarantine_only", is_flag=True,
              help="Remove the quarantined entries (any prune removes them first; alone, only them).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@remote_target
def cache_prune(engines: str | None, max_size: str | None, older_than: str | None, quarantine_only: bool,
                dry_run: bool, remote: str | None) -> None:
    """Remove every quarantined entry, then least recently used ones; pinned and in-use entries stay."""
    from trtbuild.store.housekeeping import parse_age, parse_size, plan_prune
    from trtbuild.store.local import Store

    if max_size is None and older_than is None and not quarantine_only:
        raise InputError("cache prune: give --max-size, --older-than and/or --quarantine")
    if remote is not None and quarantine_only:
        raise InputError("cache prune: --quarantine is the local store's; on the remote, `cache verify --remote` "
                         "moves damaged entries aside and --max-size/--older-than prune")
    if remote is not None:
        return _remote_prune(remote, parse_size(max_size) if max_size else None,
                             parse_age(older_than) if older_than else None, dry_run)
    store = Store(engines)
    plan = plan_prune(store, parse_size(max_size) if max_size else None, parse_age(older_than) if older_than else None)
    verb = "would remove" if dry_run else "removed"
    for path, size, when in plan.remove_quarantined:
        if not dry_run:
            store.remove_quarantined(path)
        click.echo(f"{verb} quarantine/{path.name} ({human_size(size)}, quarantined {human_time(when)})")
    for entry in plan.remove:
        if not dry_run:
            store.remove(entry)
        click.echo(f"{verb} {entry.path.name} ({human_size(entry.size())}, last used {human_time(entry.manifest.get('last_used'))})")
    for entry in plan.kept_pinned:
        click.echo(f"kept   {entry.path.name} (pinned)")
    for entry in plan.kept_in_use:
        click.echo(f"kept   {entry.path.name} (in use)")
    click.echo(f"store: {human_size(plan.size_before)} -> {human_size(plan.size_after)}")


@cache.command("explain")
@recipe_arg
@engines_option
@json_option
def cache_explain(recipe: str, engines: str | None, as_json: bool) -> None:
    """Hit (exit 0) or miss (exit 1) for a recipe; on a miss, the key fields that differ from the nearest entry."""
    from trtbuild.builder import explain

    result = explain(load_recipe_file(recipe), engines)
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
    """Hits, misses, builds, the build seconds that hits saved (each process's first hit of an entry saved that
    entry's build time; a later hit of it in the same process, or one that waited for the build, saved none),
    and what the store and its quarantine hold."""
    from trtbuild.store.housekeeping import stats
    from trtbuild.store.local import Store

    counts = stats(Store(engines))
    if as_json:
        click.echo(json.dumps(counts))
        return
    click.echo(f"hits {counts['hits']}  misses {counts['misses']}  builds {counts['builds']}  "
               f"build time {counts['build_s']:.1f} s  saved by hits {counts['build_s_saved']:.1f} s "
               "(a hit saves its entry's build time, once a process)")
    click.echo(f"entries {counts['entries']} ({human_size(counts['entries_bytes'])})  quarantined {counts['quarantined']} "
               f"({human_size(counts['quarantine_bytes'])}; `trtbuild cache prune --quarantine` removes them)")


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
    store, rem = Store(engines), open_remote(remote)
    if ref is not None:
        entry = store.find(ref)
        if problems := verify(entry, full=True):  # never spread a damaged entry to the fleet
            raise TrtbuildError(f"{entry.path.name} is corrupt here ({'; '.join(problems)}); not pushed",
                                hint=f"`trtbuild cache verify {entry.key[:12]}` moves it to quarantine")
        with build_progress(False) as progress:
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
    store, rem = Store(engines), open_remote(remote)
    if ref is not None and Path(ref).is_file():
        from trtbuild.builder import build

        with build_progress(False) as progress:
            outcome = build(load_recipe_file(ref), engines, allow_build=False, progress=progress, remote=rem.url)
        how = "pulled" if outcome.fleet.get("tier") == "remote" else "already here:"
        click.echo(f"{how} {outcome.entry.path.name} ({fleet_line(outcome.fleet)})" if how == "pulled"
                   else f"{how} {outcome.entry.path}")
    elif ref is not None:
        manifest = rem.find(ref)
        if (entry := store.lookup(manifest["key"])) is not None:
            click.echo(f"already here: {entry.path}")
        else:
            with build_progress(False) as progress:
                entry = rem.pull(store, manifest["key"], progress)
            click.echo(f"pulled {entry.path.name} from {rem.url}")
    if tactics:
        click.echo(f"tactics: {pull_tactics(rem, store)} file(s) pulled from {rem.url}")


def _remote_ls(url: str, as_json: bool) -> None:
    rem = open_remote(url)
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
        click.echo(f"{r['name']:<24} {r['backend'] or '-':<13} {r['precision'] or '-':<6} {human_size(r['size']):>9}  "
                   f"{human_time(r['created']):<16}  {str(r['pushed_by'] or '-'):<20}  {r['key'][:16]}")


def _remote_verify(url: str, refs: tuple[str, ...], all_: bool) -> None:
    rem = open_remote(url)
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

    rem = open_remote(url)
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
    click.echo(f"remote: {human_size(plan.size_before)} -> {human_size(plan.size_after)}")
