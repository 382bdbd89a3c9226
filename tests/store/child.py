"""Child process for crash and concurrency tests: ``python child.py ACTION STORE [ARGS]``.

commit SRC THREAD   commit_dir(SRC) on THREAD and print the commit id
gc                  run gc
hold-lock SECONDS   take the exclusive store lock, print "locked", sleep
"""

from __future__ import annotations

import sys
import time

from infinijup.store import Repository
from infinijup.store.gc import gc
from infinijup.store.lock import FileLock


def main(argv: list[str]) -> None:
    action, store = argv[0], argv[1]
    repo = Repository.open(store, lock_timeout=60)
    if action == "commit":
        c = repo.commit_dir(argv[2], thread=argv[3], message=f"from child {argv[3]}")
        print(c.id, flush=True)
    elif action == "gc":
        print(gc(repo), flush=True)
    elif action == "hold-lock":
        with FileLock(repo.lock_path):
            print("locked", flush=True)
            time.sleep(float(argv[2]))
    else:
        raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main(sys.argv[1:])
