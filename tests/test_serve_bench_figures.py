"""serve_bench's per-level figures from the clients' records (benchmarks/serve_bench.py), without a server."""

from __future__ import annotations

import sys
from typing import Any
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


def test_a_python_without_the_servers_packages_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    """A lent GPU machine's Python lacked FastAPI: serve_bench built an 8B engine for minutes, then every server
    failed. Now it stops first, naming the missing package, and builds nothing."""
    import os
    import subprocess

    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "fastapi.py").write_text("raise ImportError('hidden for this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])}
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "serve_bench.py"), "recipes/tiny-llama.yaml",
                           "--quick", "--engines", str(tmp_path / "engines"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=repo, env=env, timeout=120)
    assert proc.returncode != 0 and "fastapi" in proc.stderr and "nothing built" in proc.stderr, proc.stderr[-800:]
    assert not (tmp_path / "engines").exists() and not (tmp_path / "out").exists()
    assert serve_bench.server_missing() is None  # this Python has them


def test_a_run_ended_while_its_server_loads_or_serves_leaves_no_server_behind(tmp_path: Path,
                                                                               monkeypatch: Any) -> None:
    """A server still loading when the run is interrupted is killed; and SIGTERM (`timeout`, the gate) ends a
    run as SystemExit, so that the `finally` that stops a running server runs."""
    import signal
    import subprocess
    import textwrap

    import pytest

    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(cmd: list[str], **kw: Any) -> subprocess.Popen:
        proc = real([sys.executable, "-c", "import time; time.sleep(60)"], **kw)  # a server that never gets ready
        started.append(proc)
        return proc

    def interrupted(*a: Any, **kw: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_bench.subprocess, "Popen", popen)
    monkeypatch.setattr(serve_bench, "get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        serve_bench.start_server(tmp_path / "r.yaml", str(tmp_path), 1, 1, tmp_path / "server.log", 30.0)
    assert started and started[0].poll() is not None  # killed, not left loading
    marker = tmp_path / "stopped"
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(Path(serve_bench.__file__).parent)!r})
        import serve_bench
        serve_bench.exit_on_sigterm()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        finally:
            open({str(marker)!r}, "w").write("stopped")
    """)
    done = real([sys.executable, "-c", script])
    assert done.wait(60) == 128 + signal.SIGTERM and marker.read_text() == "stopped"
