"""The shared ending of the probes that run per recipe: run each, free the device's cache between
recipes, and write one JSON file with the device, torch's version and the seconds the probe took."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def run(recipes: list[str], probe: Callable[[str], dict[str, Any]], out: str, filename: str) -> None:
    t0 = time.perf_counter()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "recipes": []}
    for path in recipes:
        results["recipes"].append(probe(path))
        torch.cuda.empty_cache()
    results["seconds"] = time.perf_counter() - t0
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / filename).write_text(json.dumps(results, indent=1) + "\n")
    print(f"probe done in {results['seconds']:.0f} s")
