"""Worker processes that write a checkout's large files (checkout.py), past the one GIL
that the checkout's threads share.

Each worker is a fresh Python (exec'd, so nothing of the caller's threads or locks comes
along) that imports this module from the caller's ``sys.path``, driven by one thread of the
caller: a job, pickled onto its stdin, names the packs' directory, the file the checkout
created and the runs to write; the worker opens both itself (the file without following
links), reads, verifies and writes the runs, and answers on its stdout: ``None``, or the
error it raised (a checksum, a short read, a missing pack), which the caller raises as it
is. A worker that dies or answers garbage fails the job with ``checkout_process_died``.
Both ends are the same user's processes, so the pickles cross no trust boundary.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import struct
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from .errors import StoreError
from .packs import PackFiles
from .runs import Run, RunDecoder, write_plain_runs

_LEN = struct.Struct("<Q")
#: A worker's program: the caller's import path, then this module's loop.
_BOOT = (f"import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
         f"from {__name__} import main; main()")


class WorkerDied(StoreError):
    """A checkout worker process ended, or its answer could not be read."""

    reason = "checkout_process_died"


class Workers:
    """``n`` worker processes; ``submit`` returns a future of one job's end."""

    def __init__(self, n: int) -> None:
        argv = [sys.executable, "-c", _BOOT, json.dumps(sys.path)]
        self._threads = ThreadPoolExecutor(n, thread_name_prefix="ijcheckout-proc")
        self._idle: queue.SimpleQueue[subprocess.Popen[bytes]] = queue.SimpleQueue()
        self._procs: list[subprocess.Popen[bytes]] = []
        try:
            for _ in range(n):
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        close_fds=True)
                self._procs.append(proc)
                self._idle.put(proc)
        except BaseException:
            self.close()
            raise

    def submit(self, packs_dir: str, path: str, runs: list[Run]) -> Future[None]:
        return self._threads.submit(self._run, pickle.dumps((packs_dir, path, runs)))

    def _run(self, job: bytes) -> None:
        proc = self._idle.get()
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(_LEN.pack(len(job)) + job)
            proc.stdin.flush()
            answer = pickle.loads(_read_exact(proc.stdout, _LEN.unpack(
                _read_exact(proc.stdout, _LEN.size))[0]))
        except Exception as exc:  # noqa: BLE001 - a broken pipe, a short or bad answer
            raise WorkerDied(f"a checkout worker process ended ({exc!r}, exit status "
                             f"{proc.poll()})") from exc
        finally:
            self._idle.put(proc)
        if answer is not None:
            raise answer

    def close(self) -> None:
        """End the workers (their stdin closes) and wait for them."""
        self._threads.shutdown(wait=True)
        for proc in self._procs:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _read_exact(f: IO[bytes], n: int) -> bytes:
    data = f.read(n)
    if data is None or len(data) != n:
        raise EOFError(f"{len(data or b'')} of {n} bytes")
    return data


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """A worker's loop: jobs in, answers out, until its input closes."""
    dec = RunDecoder()
    packs: PackFiles | None = None  # one store per worker
    while True:
        head = inp.read(_LEN.size)
        if not head:
            return
        packs_dir, path, runs = pickle.loads(_read_exact(inp, _LEN.unpack(head)[0]))
        packs = packs or PackFiles(Path(packs_dir))
        answer: Any = None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                write_plain_runs(dec, fd, runs, packs.fd)
            finally:
                os.close(fd)
        except Exception as exc:  # noqa: BLE001 - sent to the caller, who raises it
            answer = exc
        try:
            data = pickle.dumps(answer)
        except Exception:  # noqa: BLE001 - an error that does not pickle goes as its text
            data = pickle.dumps(StoreError(f"checkout worker: {answer!r}"))
        out.write(_LEN.pack(len(data)) + data)
        out.flush()


def main() -> None:
    """A worker: answers go on a private copy of stdout; anything printed, to stderr."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, answers)
