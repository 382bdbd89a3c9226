"""A thin S3 client for remote stores: keys under one ``s3://bucket/prefix``, errors mapped.

The endpoint comes from ``$INFINIJUP_S3_ENDPOINT`` (else ``$AWS_ENDPOINT_URL``, else AWS);
credentials and region from boto3's usual chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``~/.aws/credentials``, ``AWS_PROFILE``, ...). Nothing here
writes or logs a secret: messages name the endpoint, bucket and key, never credentials.

Every botocore failure becomes one of the store's remote errors with a one-line message:
refused credentials -> RemoteAuthFailed, a missing bucket -> RemoteNotFound, a server that
cannot be reached or stops answering -> RemoteUnavailable. A failed precondition of a
conditional write (``If-Match`` / ``If-None-Match``) is :class:`PreconditionFailed`, which
callers turn into a RemoteConflict naming what they were moving.
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .errors import (
    RemoteAuthFailed,
    RemoteError,
    RemoteNotFound,
    RemoteUnavailable,
)

ENDPOINT_ENV = "INFINIJUP_S3_ENDPOINT"
_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
               "InvalidToken", "ExpiredToken", "403", "Forbidden"}


T = TypeVar("T")


class PreconditionFailed(Exception):
    """A conditional write found the key in another state than expected."""


@dataclass(frozen=True)
class RemoteURL:
    """A parsed ``s3://bucket/prefix``."""

    bucket: str
    prefix: str  # "" or ends with "/"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_url(url: str) -> RemoteURL:
    """Parse ``s3://bucket[/prefix]``; raise RemoteError on anything else."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise RemoteError(f"not a remote store URL: {url!r} (expected s3://bucket/prefix)")
    prefix = parts.path.strip("/")
    return RemoteURL(parts.netloc, prefix + "/" if prefix else "")


def endpoint_url() -> str | None:
    """The S3 endpoint to use (None: boto3's default, AWS)."""
    return os.environ.get(ENDPOINT_ENV) or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Bucket:
    """Objects under one remote URL. Keys given to methods are relative to the prefix."""

    def __init__(self, url: str, *, retries: int = 3) -> None:
        import boto3  # imported here: only remote commands need it
        import boto3.s3.transfer
        import botocore.config

        self.url = parse_url(url)
        self.endpoint = endpoint_url()
        where = self.endpoint or "AWS S3"
        self.where = f"{self.url} at {where}"
        config = botocore.config.Config(
            retries={"max_attempts": retries, "mode": "standard"},
            connect_timeout=10, read_timeout=60,
            s3={"addressing_style": "path"} if self.endpoint else {},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required")
        with self._errors("setting up the client"):
            session = boto3.session.Session()
            self.client = session.client("s3", endpoint_url=self.endpoint, config=config,
                                         region_name=session.region_name or "us-east-1")
        self.transfer = boto3.s3.transfer.TransferConfig(
            multipart_threshold=64 << 20, multipart_chunksize=16 << 20, max_concurrency=8)

    def key(self, name: str) -> str:
        """The full object key of ``name``."""
        return self.url.prefix + name

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except (RemoteError, PreconditionFailed):
            raise
        except Exception as exc:
            mapped = self._map(_unwrap(exc), doing)
            if mapped is None:
                raise
            raise mapped from None

    def _map(self, exc: BaseException, doing: str) -> Exception | None:
        import botocore.exceptions as bx

        if isinstance(exc, bx.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "412") or status == 412:
                return PreconditionFailed(doing)
            if code in _AUTH_CODES or status == 403:
                return RemoteAuthFailed(
                    f"{self.where} refused the credentials while {doing} ({code}); check "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws/credentials")
            if code == "NoSuchBucket":
                return self._no_bucket()
            return RemoteError(f"{self.where}: {code or status} while {doing}: "
                               f"{err.get('Message', '')}".rstrip(": "))
        if isinstance(exc, bx.NoCredentialsError):
            return RemoteAuthFailed(
                f"no credentials for {self.where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY or write ~/.aws/credentials")
        if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectionClosedError,
                            bx.ReadTimeoutError, bx.ConnectTimeoutError,
                            bx.ResponseStreamingError, ConnectionError)):
            return RemoteUnavailable(f"cannot reach {self.where} while {doing} "
                                     f"({type(exc).__name__}); retry when it is back")
        if isinstance(exc, bx.BotoCoreError):
            return RemoteError(f"{self.where}: {exc} while {doing}")
        return None

    def _no_bucket(self) -> RemoteNotFound:
        return RemoteNotFound(f"bucket {self.url.bucket!r} does not exist at "
                              f"{self.endpoint or 'AWS S3'} (create it first)")

    # -- operations ------------------------------------------------------------------------

    def check_bucket(self) -> None:
        """Raise RemoteNotFound/RemoteAuthFailed/RemoteUnavailable unless the bucket answers."""
        import botocore.exceptions as bx

        with self._errors("opening the bucket"):
            try:
                self.client.head_bucket(Bucket=self.url.bucket)
            except bx.ClientError as exc:  # HEAD has no body: a 404 is the bucket's
                meta = exc.response.get("ResponseMetadata", {})
                if meta.get("HTTPStatusCode") == 404:
                    raise self._no_bucket() from None
                raise

    def get(self, name: str) -> tuple[bytes, str] | None:
        """(content, ETag) of ``name``, or None if it does not exist."""
        import botocore.exceptions as bx

        with self._errors(f"reading {name}"):
            try:
                r = self.client.get_object(Bucket=self.url.bucket, Key=self.key(name))
            except bx.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise
            return r["Body"].read(), r["ETag"]

    def put(self, name: str, data: bytes, *, if_match: str | None = None,
            if_absent: bool = False) -> str:
        """Write ``name``; with ``if_match`` (an ETag) or ``if_absent`` conditionally (raises
        PreconditionFailed). Returns the new ETag."""
        kwargs: dict[str, Any] = {}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        elif if_absent:
            kwargs["IfNoneMatch"] = "*"
        with self._errors(f"writing {name}"):
            r = self.client.put_object(Bucket=self.url.bucket, Key=self.key(name), Body=data,
                                       **kwargs)
            return str(r.get("ETag", ""))

    def list(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix``: name (relative to the remote's prefix) -> size."""
        out: dict[str, int] = {}
        strip = len(self.url.prefix)
        with self._errors(f"listing {prefix}"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.url.bucket, Prefix=self.key(prefix))
            for page in pages:
                for obj in page.get("Contents", []):
                    out[obj["Key"][strip:]] = int(obj["Size"])
        return out

    def upload(self, name: str, path: Path) -> None:
        """Upload a file (multipart when large)."""
        with self._errors(f"uploading {name}"):
            self.client.upload_file(str(path), self.url.bucket, self.key(name),
                                    Config=self.transfer)

    def delete(self, name: str) -> None:
        """Remove ``name`` (no error if it is absent)."""
        with self._errors(f"deleting {name}"):
            self.client.delete_object(Bucket=self.url.bucket, Key=self.key(name))

    def upload_parts(self, name: str, count: int, part: Callable[[int], bytes]) -> None:
        """Write ``name`` as ``count`` parts, ``part(i)`` giving the bytes of part ``i``
        (every one but the last at least 5 MiB), made and sent by the transfer's
        concurrency of threads (a multipart upload; one PUT when ``count`` is 1). A failure
        aborts the upload: nothing is left under ``name``."""
        if count == 1:
            self.put(name, part(0))
            return
        bucket, key = self.url.bucket, self.key(name)
        with self._errors(f"uploading {name}"):
            upload = self.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            try:
                def send(i: int) -> dict[str, Any]:
                    r = self.client.upload_part(Bucket=bucket, Key=key, UploadId=upload,
                                                PartNumber=i + 1, Body=part(i))
                    return {"PartNumber": i + 1, "ETag": r["ETag"]}

                parts = run_parallel(send, range(count), self.transfer.max_concurrency)
                self.client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload,
                    MultipartUpload={"Parts": parts})
            except BaseException:
                with contextlib.suppress(Exception):
                    self.client.abort_multipart_upload(Bucket=bucket, Key=key,
                                                       UploadId=upload)
                raise

    def read_range(self, name: str, start: int, stop: int, piece: int
                   ) -> Iterator[tuple[bytes, int]]:
        """Bytes ``start`` to ``stop`` (exclusive) of ``name`` in pieces of ``piece`` bytes
        (the last one shorter when the object ends first; none when it ends before
        ``start``), each with the object's whole size; RemoteNotFound when it does not
        exist."""
        import botocore.exceptions as bx

        with self._errors(f"reading {name}"):
            try:
                r = self.client.get_object(Bucket=self.url.bucket, Key=self.key(name),
                                           Range=f"bytes={start}-{stop - 1}")
            except bx.ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code in ("NoSuchKey", "404"):
                    raise RemoteNotFound(f"{name} is not on {self.where}") from None
                if code == "InvalidRange":  # the object ends before ``start``
                    return
                raise
            total = int(str(r["ContentRange"]).rsplit("/", 1)[1])
            body = r["Body"]
            try:
                while True:
                    parts, have = [], 0
                    while have < piece:
                        got = body.read(piece - have)
                        if not got:
                            break
                        parts.append(got)
                        have += len(got)
                    if not have:
                        return
                    yield b"".join(parts) if len(parts) != 1 else parts[0], total
                    if have < piece:
                        return
            finally:
                body.close()

    def download(self, name: str, path: Path) -> None:
        """Download ``name`` to ``path`` (ranged parallel GETs when large)."""
        with self._errors(f"downloading {name}"):
            self.client.download_file(self.url.bucket, self.key(name), str(path),
                                      Config=self.transfer)


def run_parallel(fn: Callable[[int], T], items: range, workers: int) -> list[T]:
    """``[fn(i) for i in items]`` on up to ``workers`` threads; the first failure is raised
    once the calls already running end, and the calls not started yet are dropped."""
    with ThreadPoolExecutor(max(1, min(workers, len(items))),
                            thread_name_prefix="ij-transfer") as pool:
        futures = [pool.submit(fn, i) for i in items]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in done:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


def _unwrap(exc: BaseException) -> BaseException:
    """The botocore error under boto3's transfer wrappers (S3UploadFailedError,
    RetriesExceededError)."""
    for _ in range(4):
        inner = getattr(exc, "last_exception", None) or exc.__cause__ or exc.__context__
        if inner is None or type(exc).__module__.startswith("botocore"):
            break
        exc = inner
    return exc
