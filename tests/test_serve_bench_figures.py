"""serve_bench's per-level figures from the clients' records (benchmarks/serve_bench.py), without a server."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_bench  # noqa: E402


def test_the_first_wave_s_ttft_is_told_apart_from_the_requests_after_it() -> None:
    """Three clients: their first requests, sent together, queue behind each other's prompts (TTFT 100-300 ms);
    the requests after them arrive one at a time (10-20 ms). The figures keep them apart, order by sending time
    whatever order the records came in, leave failed requests out and keep each request's row."""
    rec = [{"sent_s": s, "prompt": 512, "ahead": a, "ttft_s": t, "tpot_s": 0.005}
           for s, a, t in [(0.0, 0, 0.1), (0.001, 1, 0.2), (0.002, 2, 0.3), (0.5, 0, 0.01), (0.6, 0, 0.02)]]
    rec.insert(2, {"i": 9, "error": "refused"})
    fig = serve_bench.ttft_waves(list(reversed(rec)), clients=3)
    assert fig["ttft_ms_first_wave_p50"] == 200.0 and fig["ttft_ms_after_p50"] in (10.0, 20.0)
    assert fig["ahead"] == {"p50": 0, "p99": 2}
    assert [r[0] for r in fig["per_request"]] == [0.0, 0.001, 0.002, 0.5, 0.6]
    assert fig["per_request"][1] == [0.001, 512, 1, 200.0, 5.0]
    assert serve_bench.ttft_waves([], clients=4)["ttft_ms_first_wave_p50"] is None
