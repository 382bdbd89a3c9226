"""Hardware fingerprints: what a GPU snapshot needs to be restored.

A snapshot's device memory can only go back onto GPUs of the same model and count, under a
driver of the same major version. Other GPUs of the same model (other UUIDs) are fine: the
driver maps the saved devices onto them (:func:`remap`).

Several GPUs (issue 33): the fingerprint also records how each pair of GPUs is joined
(``links``: NVLink, PCIe peer-to-peer, or nothing but host memory). A kernel that used two
cards joined by NVLink may have peer mappings between them; the cards a restore maps them onto
must be joined the same way, so :func:`remap` prefers such cards and :func:`link_mismatches`
names what differs. The restored process keeps its device ordinals: its ``cuda:0`` is the card
that the saved ``cuda:0`` was mapped onto.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory_total: int
    mig_enabled: bool = False


LINK_WORDS = {"nvlink": "NVLink", "pcie": "PCIe peer-to-peer", "host": "host memory only"}


@dataclass(frozen=True)
class Link:
    """How GPUs ``a`` and ``b`` (their indexes) reach each other: ``kind`` is "nvlink",
    "pcie" (peer-to-peer over PCIe) or "host" (no peer access); ``path`` is NVML's common
    ancestor, for the record."""

    a: int
    b: int
    kind: str
    path: str = ""


@dataclass(frozen=True)
class Fingerprint:
    gpus: tuple[GpuInfo, ...]
    driver_version: str
    cuda_driver_version: int  # e.g. 13000 for CUDA 13.0
    links: tuple[Link, ...] = ()  # every pair of ``gpus``; empty in snapshots before issue 33
    extra: dict = field(default_factory=dict, compare=False)

    def to_json(self) -> dict:
        out = {"gpus": [asdict(g) for g in self.gpus], "driver_version": self.driver_version,
               "cuda_driver_version": self.cuda_driver_version}
        if self.links:
            out["links"] = [asdict(link) for link in self.links]
        return out

    @classmethod
    def from_json(cls, data: dict) -> Fingerprint:
        return cls(gpus=tuple(GpuInfo(**g) for g in data.get("gpus", [])),
                   driver_version=str(data.get("driver_version", "")),
                   cuda_driver_version=int(data.get("cuda_driver_version", 0)),
                   links=tuple(Link(**k) for k in data.get("links", [])))

    def link(self, uuid_a: str, uuid_b: str) -> str | None:
        """The kind of link between two of these GPUs (None: not recorded)."""
        index = {g.uuid: g.index for g in self.gpus}
        a, b = index.get(uuid_a), index.get(uuid_b)
        for k in self.links:
            if {k.a, k.b} == {a, b}:
                return k.kind
        return None


def _major(version: str) -> str:
    return version.split(".")[0] if version else ""


def mismatches(saved: Fingerprint, current: Fingerprint) -> list[str]:
    """Why ``saved`` cannot be restored on ``current`` (empty: it can)."""
    reasons = []
    if len(current.gpus) < len(saved.gpus):
        reasons.append(f"the snapshot used {len(saved.gpus)} GPU(s), this machine has "
                       f"{len(current.gpus)}")
    saved_models = sorted(g.name for g in saved.gpus)
    current_models = sorted(g.name for g in current.gpus)[: len(saved_models)]
    if saved_models and saved_models != current_models:
        reasons.append(f"GPU model differs: snapshot {', '.join(saved_models)}, here "
                       f"{', '.join(current_models) or 'none'}")
    if saved.driver_version and _major(saved.driver_version) != _major(current.driver_version):
        reasons.append(f"NVIDIA driver differs: snapshot {saved.driver_version}, here "
                       f"{current.driver_version or 'none'}")
    return reasons


def remap(saved: Fingerprint, current: Fingerprint,
          used: list[str] | None = None) -> list[tuple[str, str]]:
    """Pairs (saved uuid, current uuid) of the same model, identity where UUIDs match. The GPUs
    in ``used`` (the ones the kernel held memory on) go first, onto cards joined as they were
    (:func:`link_mismatches`) where the machine has such cards; the others follow in order."""
    used = [u for u in (used or []) if any(g.uuid == u for g in saved.gpus)]
    chosen = _linked_assignment(saved, current, used) or {}
    pairs = []
    free = [c for c in current.gpus if c.uuid not in chosen.values()]
    for g in saved.gpus:
        if g.uuid in chosen:
            pairs.append((g.uuid, chosen[g.uuid]))
            continue
        same = next((c for c in free if c.uuid == g.uuid), None) or \
            next((c for c in free if c.name == g.name), None)
        if same is None:
            break
        free.remove(same)
        pairs.append((g.uuid, same.uuid))
    return pairs


MAX_TRIES = 50_000  # assignments tried before settling for any (8 GPUs of one model: 40,320)


def _linked_assignment(saved: Fingerprint, current: Fingerprint,
                       used: list[str]) -> dict[str, str] | None:
    """Used saved GPUs onto current GPUs of the same model with every link between them of the
    same kind, staying put where possible; None when there is no such assignment (or nothing
    to choose: one GPU, or no links recorded)."""
    if len(used) < 2 or not saved.links or not current.links:
        return None
    names = {g.uuid: g.name for g in saved.gpus}
    here = [c.uuid for c in current.gpus]
    tries = [0]

    def place(i: int, taken: dict[str, str]) -> dict[str, str] | None:
        if i == len(used):
            return dict(taken)
        u = used[i]
        options = sorted((c for c in current.gpus if c.name == names[u]
                          and c.uuid not in taken.values()),
                         key=lambda c: (c.uuid != u, here.index(c.uuid)))
        for c in options:
            tries[0] += 1
            if tries[0] > MAX_TRIES:
                return None
            if all(saved.link(u, v) == current.link(c.uuid, w) for v, w in taken.items()):
                taken[u] = c.uuid
                found = place(i + 1, taken)
                if found:
                    return found
                del taken[u]
        return None

    return place(0, {})


def link_mismatches(saved: Fingerprint, current: Fingerprint, mapping: dict[str, str],
                    used: list[str]) -> list[str]:
    """How the links between the used GPUs differ once mapped (empty: joined as they were).
    A snapshot or a machine without recorded links has nothing to compare."""
    if not saved.links or not current.links:
        return []
    index = {g.uuid: g.index for g in saved.gpus}
    here = {g.uuid: g.index for g in current.gpus}
    used = sorted((u for u in used if u in mapping and u in index), key=index.get)
    out = []
    for i, u in enumerate(used):
        for v in used[i + 1:]:
            was, now = saved.link(u, v), current.link(mapping[u], mapping[v])
            if was and now and was != now:
                out.append(f"GPUs {index[u]} and {index[v]} of the snapshot were joined by "
                           f"{LINK_WORDS.get(was, was)}; GPUs {here[mapping[u]]} and "
                           f"{here[mapping[v]]} here, which would take their place, by "
                           f"{LINK_WORDS.get(now, now)}")
    return out
