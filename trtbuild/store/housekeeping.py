"""Explaining, pruning and counting the store: why a recipe missed, what to evict, what was saved.

A miss is explained the way ccache explains one: the key material of the recipe is compared, leaf
by leaf, with that of the nearest existing entry, and the differing fields are named.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtbuild.store import fingerprint
from trtbuild.errors import InputError
from trtbuild.store.local import Entry, Store


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are leaves (a bucket list is one field to a user)."""
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    fa, fb = flatten(a), flatten(b)
    return [(k, fa.get(k, "<absent>"), fb.get(k, "<absent>")) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def nearest(material: dict[str, Any], entries: list[Entry],
            name: str | None = None) -> tuple[Entry, list[tuple[str, Any, Any]]] | None:
    """The entry whose key material differs from `material` in the fewest fields (same name first)."""
    scored = [(len(d), e.name != name, e.path.name, e, d)
              for e in entries for d in [differences(e.manifest.get("key_material", {}), material)]]
    if not scored:
        return None
    _, _, _, entry, diff = min(scored, key=lambda s: s[:3])
    return entry, diff


def incompatibility(material: dict[str, Any], entries: list[Entry]) -> str | None:
    """For a miss: an entry built from the same recipe fields and weights, but for another device or
    toolchain, described in words ("built for NVIDIA H200 sm90 with torch 2.11.0; this is ...")."""
    for e in entries:
        km = e.manifest.get("key_material", {})
        if km.get("recipe") == material["recipe"] and (km.get("device") != material["device"]
                                                       or km.get("backend") != material["backend"]):
            theirs = fingerprint.describe(km.get("device", {}), km.get("backend", {}).get("toolchain", {}))
            ours = fingerprint.describe(material["device"], material["backend"]["toolchain"])
            return f"{e.path.name} was built for {theirs}; this is {ours}"
    return None


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise InputError(f"--max-size: expected a size like 50G or 800M, got {text!r}")
    return int(float(m.group(1)) * 1000 ** " KMGT".index(m.group(2).upper() or " "))


def parse_age(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not m:
        raise InputError(f"--older-than: expected an age like 30d, 12h or 90m, got {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


@dataclass
class PrunePlan:
    remove: list[Entry]
    kept_pinned: list[Entry]
    kept_in_use: list[Entry]
    size_before: int  # entries and quarantine together: what the store takes on disk
    size_after: int
    remove_quarantined: list[tuple[Path, int, float]] = field(default_factory=list)  # (folder, bytes, when)


def plan_prune(store: Store, max_size: int | None, older_than_s: float | None) -> PrunePlan:
    """What to remove. The whole quarantine first, whatever the limits: a quarantined entry is a corrupt or
    incompatible copy kept only to be looked at, never served, so a user pruning the store wants it gone (and
    `cache prune --quarantine`, with no limit, removes only it). Then engines least recently used first:
    everything older than the age limit, then the oldest-used until the store fits in `max_size`. Pinned
    entries and entries open in a running process stay."""
    entries = sorted(store.entries(), key=lambda e: e.manifest.get("last_used") or 0)
    gone_q = sorted(store.quarantined_entries(), key=lambda q: q[2])  # oldest first, as they are listed
    pinned = [e for e in entries if store.is_pinned(e.key)]
    busy = [e for e in entries if e not in pinned and store.is_in_use(e.key)]
    candidates = [e for e in entries if e not in pinned and e not in busy]
    total = sum(e.size() for e in entries) + sum(q[1] for q in gone_q)
    now = time.time()
    remove: list[Entry] = []
    if older_than_s is not None:
        remove = [e for e in candidates if now - (e.manifest.get("last_used") or 0) > older_than_s]
    size = total - sum(e.size() for e in remove) - sum(q[1] for q in gone_q)
    if max_size is not None:
        for e in candidates:
            if size <= max_size:
                break
            if e not in remove:
                remove.append(e)
                size -= e.size()
    return PrunePlan(remove, pinned, busy, total, size, gone_q)


def stats(store: Store) -> dict[str, Any]:
    """Counts from the store's event log (hits, misses, builds, build seconds the hits saved) and what the store
    holds now: its entries and its quarantine, with their sizes."""
    quarantined = store.quarantined_entries()
    counts: dict[str, Any] = {"hits": 0, "misses": 0, "builds": 0, "build_s": 0.0, "build_s_saved": 0.0,
                              "entries": len(store.entries()), "entries_bytes": sum(e.size() for e in store.entries()),
                              "quarantined": len(quarantined), "quarantine_bytes": sum(q[1] for q in quarantined)}
    try:
        lines = store.stats_file.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a torn last line after a crash
        if ev.get("event") == "hit":
            counts["hits"] += 1
            counts["build_s_saved"] += float(ev.get("saved_s") or 0.0)
        elif ev.get("event") == "miss":
            counts["misses"] += 1
        elif ev.get("event") == "build":
            counts["builds"] += 1
            counts["build_s"] += float(ev.get("build_s") or 0.0)
    return counts
