"""Progress of a snapshot's ingest: the bytes the store has read of the images, reported
as ``store`` phases (each further 5%)."""

from __future__ import annotations

from collections.abc import Callable

from ..store.incremental import add_changed_file

Progress = Callable[[str, dict], None]


class IngestProgress:
    """Counts the bytes read into the store; reports each further 5% as a ``store`` phase."""

    def __init__(self, on_progress: Progress, total: int) -> None:
        self.on_progress = on_progress
        self.total = max(1, total)
        self.done = 0
        self.step = max(1, self.total // 20)
        self.next = self.step

    def __call__(self, n: int) -> None:
        self.done += n
        if self.done >= self.next:
            self.next = self.done + self.step
            frac = min(1.0, self.done / self.total)
            self.on_progress("store", {"percent": 60 + 35 * frac, "message":
                                       f"stored {self.done / 2**30:.2f} of "
                                       f"{self.total / 2**30:.2f} GiB"})


class CountingWriter:
    """What ``entries_from_dir`` needs of a Writer, counting the bytes it reads."""

    def __init__(self, writer, count: Callable[[int], None]) -> None:  # noqa: ANN001
        self.repo = writer.repo
        self._writer = writer
        self._count = count

    def add_file(self, path, *, base=None):  # noqa: ANN001, ANN201
        with open(path, "rb", buffering=0) as f:
            return self._writer.add_stream(CountedFile(f, self._count), base=base)

    def add_changed_file(self, fd: int, *, base, changed):  # noqa: ANN001, ANN201
        blob = add_changed_file(self._writer, fd, base=base, changed=changed)
        self._count(blob.size)  # done, whatever share of it was read
        return blob


class CountedFile:
    def __init__(self, f, count: Callable[[int], None]) -> None:  # noqa: ANN001
        self._f = f
        self._count = count

    def readinto(self, buf) -> int:  # noqa: ANN001
        n = self._f.readinto(buf)
        if n:
            self._count(n)
        return n
