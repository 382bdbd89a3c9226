"""Making room on a GPU without costing any kernel its state (issue 27).

Releasing an idle kernel's GPU memory moves it into host memory, where it stays until that
kernel wakes. A release that host memory cannot hold fails in the driver
(``CUDA_ERROR_OPERATING_SYSTEM``), or worse, the kernel is OOM-killed and Jupyter's restarter
starts a fresh one: its state is lost because another notebook ran a cell. So before anything
is released the plan checks where the bytes go: into host memory that holds them with a margin;
or, for a kernel host memory cannot keep but can pass through, into the store: it is hibernated
(snapshotted, its process ended; its GPU memory passes through host memory on the way and leaves
it); or nowhere, and then the wake that asked for room is refused with the reason, every kernel
left as it was.

This module only decides (the numbers come from NVML and /proc/meminfo, serverext/
hibernation.py acts), so the decision is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1 << 30
MIN_MARGIN = 2 * GIB  # host memory a release must leave: the kernels and the system go on
MARGIN_SHARE = 0.05


@dataclass(frozen=True)
class Candidate:
    """An idle kernel that could give way: its id, what a person calls it, what it holds."""

    kernel_id: str
    label: str
    held: dict[str, int]  # bytes on each GPU, by UUID

    @property
    def bytes(self) -> int:
        return sum(self.held.values())


@dataclass(frozen=True)
class RoomPlan:
    release: list[str] = field(default_factory=list)  # kernel ids, in this order
    refusal: str | None = None  # why the room cannot be made (nothing is released then)
    hibernate: list[str] = field(default_factory=list)  # kernel ids, before the releases


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, from /proc/meminfo."""
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * 1024
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)


def margin_for(total: int) -> int:
    return max(MIN_MARGIN, int(total * MARGIN_SHARE))


def fmt(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 10**8 else f"{n / 1e6:.0f} MB"


def gpu_name(uuid: str) -> str:
    return uuid[:12] if uuid.startswith("GPU-") else uuid


def release_refusal(held: dict[str, int], label: str, available: int, margin: int) -> str | None:
    """Why releasing one kernel's GPU memory would not fit in host memory (None: it fits)."""
    need = sum(held.values())
    if need + margin <= available:
        return None
    return (f"releasing '{label}' needs {fmt(need)} of host memory, {fmt(available)} free "
            f"(and {fmt(margin)} kept for the rest of the machine): it keeps its GPU memory")


def plan_room(need: dict[str, int], free: dict[str, int], candidates: list[Candidate],
              available: int, margin: int, can_hibernate: bool = False) -> RoomPlan:
    """Which idle kernels give way so that ``need`` fits on its GPUs. ``candidates`` come in
    the order they should give way (least recently active first). Each is released if host
    memory holds it besides the releases before it; else hibernated (``can_hibernate``) if host
    memory holds it on its way to the store (hibernations run first, one at a time, and leave
    host memory as it was); else passed over. Nothing moves unless the whole need is met."""
    free0, free = free, dict(free)
    host = available - margin
    release: list[str] = []
    hibernate: list[str] = []
    passed_over: list[Candidate] = []

    def short() -> dict[str, int]:
        return {g: n - free.get(g, 0) for g, n in need.items() if n > free.get(g, 0)}

    for c in candidates:
        missing = short()
        if not missing:
            break
        if not set(missing) & {g for g, n in c.held.items() if n > 0}:
            continue
        if c.bytes <= host:
            release.append(c.kernel_id)
            host -= c.bytes
        elif can_hibernate and c.bytes <= available - margin:
            hibernate.append(c.kernel_id)
        else:
            passed_over.append(c)
            continue
        for g, n in c.held.items():
            free[g] = free.get(g, 0) + n
    missing = short()
    if not missing:
        return RoomPlan(release, None, hibernate)
    wants = "; ".join(f"needs {fmt(need[g])} on GPU {gpu_name(g)}, {fmt(free0.get(g, 0))} free"
                      for g in missing)
    if passed_over:
        verb = "releasing or hibernating" if can_hibernate else "releasing"
        why = "; ".join(f"{verb} the idle kernel '{c.label}' needs {fmt(c.bytes)} of host "
                        f"memory, {fmt(available)} free" for c in passed_over)
    else:
        why = "no idle kernel holds enough memory there to give way"
    return RoomPlan([], f"{wants}; {why}")
