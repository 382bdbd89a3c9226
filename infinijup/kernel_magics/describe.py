"""What a snapshot says about the kernel it saved: the last cell and the user's variables.

Computed in the kernel just before the dump, cheaply: nothing is pickled or copied beyond
small buffers, and the user's objects are only looked at (type, size, shape, identity, the bytes
of small arrays). The result goes into the commit's metadata::

    "cell": {"execution_count": int | None, "source": "<first line, <= 200 chars>"}
    "variables": {"items": [{"name", "type", "size", "shape", "fp", "changed", "value"}],
                  "truncated"}

``value`` (where it is cheap and safe) is what Compare shows: the ``repr`` of a number, a short
string or a small container of such (builtin types only: no user ``__repr__`` runs), cut to 60
characters, and for a numeric numpy array of at most a million elements its min, max and mean.
Variables whose name says they hold a secret (password, token, secret, key, credential) never
get one.

``fp`` is a change fingerprint: equal fingerprints mean "treat as unchanged". It hashes the
bytes of small arrays, strings and bytes (and samples of large contiguous arrays), the columns
of small pandas objects, a tensor's storage and version counter, and walks containers and
instance attributes (a bounded deep fingerprint: at most 10,000 objects a variable and 30,000 a
snapshot), so a change made in place (an append to a list inside a dict, an item of a nested
list, an attribute of an object) is seen. A variable too large to look at fully is marked
``"partial": true``: unchanged there means "no change seen". ``changed`` compares with the fingerprints of this kernel's previous snapshot,
kept here: a kernel restored from a snapshot holds the fingerprints of that very snapshot, which
is the parent of its next one.
"""

from __future__ import annotations

import collections
import hashlib
import sys
import types

MAX_ITEMS = 500  # variables listed in a commit
MAX_NAMES = 10_000  # names looked at, at most
MAX_SOURCE = 200
FULL_HASH_BYTES = 1 << 20  # buffers up to this size are hashed whole
SAMPLE_BLOCKS, SAMPLE_BLOCK = 16, 4096  # larger contiguous buffers: this many blocks of this size
HASH_BUDGET = 32 << 20  # bytes hashed per snapshot, at most; past it, identity only
MAX_ELEMENTS = 1000  # containers up to this length are walked, element by element
MAX_NODES = 10_000  # objects visited per variable, at most (a bounded deep fingerprint)
SNAPSHOT_NODES = 30_000  # and per snapshot, all variables together (about 0.1 s)
MAX_DEPTH = 32
PARTIAL = "~"  # marks the fingerprint of a variable not looked at fully

# IPython's own names in the user namespace (also excluded when the user rebinds them).
_IPYTHON_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython"})
_SIZED = (list, tuple, dict, set, frozenset, collections.OrderedDict, collections.defaultdict,
          collections.deque, collections.Counter)

_parent_fps: dict[str, str] = {}  # name -> fp at this kernel's last snapshot
_rollback: dict[str, str] | None = None  # the fps before the snapshot now in flight


def first_line(source: str) -> str:
    for line in (source or "").splitlines():
        if line.strip():
            return line.rstrip()[:MAX_SOURCE]
    return ""


def describe(ip) -> dict:  # noqa: ANN001 - IPython's shell
    """``{"cell", "variables"}`` for a snapshot taken now; the fingerprints become the parent's.

    The cell is the last one IPython stored: from ``%snapshot``, the running cell itself (IPython
    stores a cell and moves ``execution_count`` past it before running it).
    """
    global _parent_fps, _rollback
    count = int(ip.execution_count) - 1
    hist = ip.history_manager.input_hist_raw if ip.history_manager is not None else []
    cell = {"execution_count": count if count > 0 else None,
            "source": first_line(hist[-1]) if len(hist) > 1 and count > 0 else ""}
    items, fps, truncated = _variables(ip)
    _rollback, _parent_fps = _parent_fps, fps
    return {"cell": cell, "variables": {"items": items, "truncated": truncated}}


def parent_names() -> list[str]:
    """The variables of this kernel's last snapshot (what a next one compares with)."""
    return list(_parent_fps)


def forget() -> None:
    """The snapshot just described was not committed: its parent's fingerprints stay."""
    global _parent_fps, _rollback
    if _rollback is not None:
        _parent_fps, _rollback = _rollback, None


def committed() -> None:
    global _rollback
    _rollback = None


def _user_variables(ip) -> list[tuple[str, object]]:  # noqa: ANN001
    hidden = ip.user_ns_hidden
    missing = object()
    out = []
    for name, value in list(ip.user_ns.items()):
        if type(name) is not str or name.startswith("_") or name in _IPYTHON_NAMES:
            continue
        if hidden.get(name, missing) is value or issubclass(type(value), types.ModuleType):
            continue
        out.append((name, value))
    out.sort(key=lambda nv: nv[0])
    return out


def _variables(ip) -> tuple[list[dict], dict[str, str], bool]:  # noqa: ANN001
    pairs = _user_variables(ip)
    truncated = len(pairs) > MAX_NAMES
    libs = _Libraries()
    budget = [HASH_BUDGET, SNAPSHOT_NODES]  # bytes hashed, objects walked
    items, fps = [], {}
    for name, value in pairs[:MAX_NAMES]:
        item = _describe_value(name, value, libs, budget)
        item["changed"] = _parent_fps.get(name) != item["fp"]
        fps[name] = item["fp"]
        items.append(item)
    if len(items) > MAX_ITEMS:  # keep what changed first, then the rest by name
        truncated = True
        keep = sorted(items, key=lambda it: not it["changed"])[:MAX_ITEMS]
        items = sorted(keep, key=lambda it: it["name"])
    return items, fps, truncated


class _Libraries:
    """The array libraries the user has imported (never imported by us)."""

    def __init__(self) -> None:
        np, torch, pd = (sys.modules.get(m) for m in ("numpy", "torch", "pandas"))
        self.ndarray = getattr(np, "ndarray", None)
        self.tensor = getattr(torch, "Tensor", None)
        self.frame = getattr(pd, "DataFrame", None)
        self.series = getattr(pd, "Series", None)
        self.np = np


def _is(t: type, cls: type | None) -> bool:
    return cls is not None and issubclass(t, cls)


def _describe_value(name: str, value: object, libs: _Libraries, budget: list[int]) -> dict:
    t = type(value)
    try:
        size, shape, fp = _measure(value, t, libs, budget)
    except Exception:  # an odd object: identity alone
        size, shape, fp = _object_size(value, t), None, _digest(t, b"id", id(value)) + PARTIAL
    item = {"name": name, "type": t.__name__, "size": int(size), "shape": shape, "fp": fp}
    try:
        shown = preview(name, value, t, libs)
    except Exception:  # a preview is a courtesy: never a reason to fail a snapshot
        shown = None
    if shown is not None:
        item["value"] = shown
    if fp.endswith(PARTIAL):
        item["partial"] = True  # too large to look at fully: "unchanged" may miss a change
    return item


MAX_PREVIEW = 60
MAX_PREVIEW_ITEMS = 10
MAX_STATS_ELEMENTS = 1_000_000
_SECRET_WORDS = ("pass", "pwd", "token", "secret", "key", "cred", "auth")
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _plain(value: object, depth: int = 0) -> bool:
    """A value of builtin types only, small enough that its repr is cheap and runs no user
    code."""
    t = type(value)
    if t in _PLAIN:
        return not (t in (str, bytes) and len(value) > 4 * MAX_PREVIEW)
    if t in (list, tuple, set, frozenset) and depth < 2 and len(value) <= MAX_PREVIEW_ITEMS:
        return all(_plain(v, depth + 1) for v in value)
    if t is dict and depth < 2 and len(value) <= MAX_PREVIEW_ITEMS:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def preview(name: str, value: object, t: type, libs: _Libraries) -> str | None:
    """A short view of ``value`` for Compare, or None (see the module's docstring)."""
    lowered = name.lower()
    if any(word in lowered for word in _SECRET_WORDS):
        return None
    if _is(t, libs.ndarray):
        if value.size == 0 or value.size > MAX_STATS_ELEMENTS or value.dtype.kind not in "biuf":
            return None
        return (f"min {value.min().item():.4g}, max {value.max().item():.4g}, "
                f"mean {value.mean().item():.4g}")
    if not _plain(value):
        return None
    text = repr(value)
    return text if len(text) <= MAX_PREVIEW else text[:MAX_PREVIEW - 1] + "…"


def _measure(value: object, t: type, libs: _Libraries, budget: list[int]):
    if _is(t, libs.ndarray):
        return int(value.nbytes), str(value.shape), _array_fp(value, t, libs, budget)
    if _is(t, libs.tensor):
        size = value.element_size() * value.nelement()
        shape = tuple(value.shape)
        fp = _digest(t, id(value), value.data_ptr(), value._version, shape, str(value.dtype),
                     str(value.device))
        return size, str(shape), fp
    if _is(t, libs.frame) or _is(t, libs.series):
        usage = value.memory_usage(index=True, deep=False)
        size = int(usage.sum()) if _is(t, libs.frame) else int(usage)
        return size, str(value.shape), _frame_fp(value, t, size, libs, budget)
    if t is bool or t is int:
        return sys.getsizeof(value), None, _digest(t, hash(value), value.bit_length())
    if t is float or t is complex or value is None:
        return sys.getsizeof(value), None, _digest(t, repr(value))
    if t is str:
        data = value.encode("utf-8", "surrogatepass") if len(value) <= FULL_HASH_BYTES else None
        return sys.getsizeof(value), None, _buffer_fp(t, value, data, budget)
    if t is bytes or t is bytearray:
        return sys.getsizeof(value), None, _buffer_fp(t, value, memoryview(value), budget)
    if t in _SIZED:
        n = len(value)
        return sys.getsizeof(value), f"len {n}", _deep_fp(value, libs, budget)
    return _object_size(value, t), None, _deep_fp(value, libs, budget)


class _Walk:
    """A bounded walk through one variable: containers, instance attributes and small arrays by
    content, so a change made in place (``d['scores'].append(4)``, ``grid[1][0] = 7``,
    ``obj.items.append(x)``) changes the fingerprint. At most ``MAX_NODES`` objects are visited
    (and the snapshot's byte budget hashed); past that the rest counts by identity and the
    variable is marked ``partial``: a change there may go unseen, and the commit says so. What
    it sees goes straight into one hash, a token at a time."""

    def __init__(self, libs: _Libraries, budget: list[int]) -> None:
        self.libs, self.budget = libs, budget
        self.nodes = min(MAX_NODES, budget[1])
        self.partial = False
        self.seen: set[int] = set()
        self.h = hashlib.blake2b(digest_size=8)

    def put(self, *parts: object) -> None:
        self.h.update(repr(parts).encode())

    def walk(self, x: object, depth: int = 0) -> None:
        if self.nodes <= 0 or depth > MAX_DEPTH:
            self.partial = True
            self.put("id", id(x))
            return
        self.nodes -= 1  # every element counts: the budget bounds the work
        t = type(x)
        if t is int:
            self.h.update(b"i%d;" % x if x.bit_length() < 4096 else b"I%d;" % hash(x))
            return
        if t is str and len(x) <= 256:
            data = x.encode("utf-8", "surrogatepass")
            self.h.update(b"s%d:" % len(data))
            self.h.update(data)
            return
        if t is bool or t is float or t is complex or x is None:
            self.h.update(repr(x).encode() + b";")
            return
        if t is str or t is bytes or t is bytearray:
            data = x.encode("utf-8", "surrogatepass") if t is str else memoryview(x)
            self.put("buf", _buffer_fp(t, x, data, self.budget))
            return
        if id(x) in self.seen:  # a cycle, or an object met twice: once is enough
            self.put("seen", id(x))
            return
        self.seen.add(id(x))
        if _is(t, self.libs.ndarray):
            self.put("array", _array_fp(x, t, self.libs, self.budget))
        elif _is(t, self.libs.tensor) or _is(t, self.libs.frame) or _is(t, self.libs.series):
            self.put("value", _measure(x, t, self.libs, self.budget)[2])
        elif t in _SIZED:  # the builtin ones only: a subclass's len or iteration is user code
            self._container(x, t, depth)
        else:
            try:
                attrs = object.__getattribute__(x, "__dict__")
            except Exception:
                attrs = None
            self.put("obj", t.__qualname__, id(x))
            if type(attrs) is dict:
                self._container(attrs, dict, depth)

    def _container(self, x, t: type, depth: int) -> None:  # noqa: ANN001
        try:
            n = len(x)
            if n > MAX_ELEMENTS:
                self.partial = True
                self.put(t.__qualname__, "len", n, "id", id(x))
                return
            self.put(t.__qualname__, n)
            if t is dict or issubclass(t, dict):
                for k, v in list(x.items()):
                    self.walk(k, depth + 1)
                    self.walk(v, depth + 1)
            elif t is set or t is frozenset:  # no order to rely on: each element apart
                parts = []
                for e in list(x):
                    sub = _Walk(self.libs, self.budget)
                    sub.nodes, sub.seen = self.nodes, self.seen
                    sub.walk(e, depth + 1)
                    self.nodes, self.partial = sub.nodes, self.partial or sub.partial
                    parts.append(sub.h.digest())
                for part in sorted(parts):
                    self.h.update(part)
            else:
                for e in list(x):
                    self.walk(e, depth + 1)
        except Exception:  # changed size while walked, or an odd container: identity alone
            self.partial = True
            self.put(t.__qualname__, "id", id(x))


def _deep_fp(value: object, libs: _Libraries, budget: list[int]) -> str:
    walk = _Walk(libs, budget)
    walk.h.update(f"{type(value).__module__}.{type(value).__qualname__}".encode())
    walk.walk(value)
    budget[1] -= min(MAX_NODES, budget[1]) - walk.nodes
    fp = walk.h.hexdigest()
    return fp + PARTIAL if walk.partial else fp


def _element(x: object) -> object:
    """An element of a small container: small immutable values by value, others by identity."""
    t = type(x)
    if t is int or t is bool:
        return (t.__name__, hash(x), x.bit_length())
    if t is float or t is complex or x is None:
        return repr(x)
    if t is str and len(x) <= 256:
        return ("str", x)
    return ("id", id(x))


def _frame_fp(value, t: type, size: int, libs: _Libraries, budget: list[int]) -> str:  # noqa: ANN001
    """A pandas object: its columns' values when small, else its identity and shape."""
    if size > FULL_HASH_BYTES or size > budget[0]:
        return _digest(t, id(value), value.shape, size)
    columns = [value] if _is(t, libs.series) else \
        [value.iloc[:, i] for i in range(value.shape[1])]
    parts = [value.shape, _array_fp(value.index.to_numpy(), libs.ndarray, libs, budget)]
    if not _is(t, libs.series):
        parts.append([str(c) for c in value.columns])
    for col in columns:
        parts.append((str(col.dtype), _array_fp(col.to_numpy(), libs.ndarray, libs, budget)))
    return _digest(t, *parts)


def _digest(t: type, *parts: object) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.__module__}.{t.__qualname__}".encode())
    for part in parts:
        h.update(b"\0" + (part if isinstance(part, bytes) else repr(part).encode()))
    return h.hexdigest()


def _buffer_fp(t: type, value: object, data, budget: list[int]) -> str:  # noqa: ANN001
    """Whole small buffers by content; larger ones by identity, length and sampled blocks."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.__module__}.{t.__qualname__}".encode())
    n = len(data) if data is not None else -1
    if data is not None and n <= FULL_HASH_BYTES and n <= budget[0]:
        budget[0] -= n
        h.update(b"content\0")
        h.update(data)
        return h.hexdigest()
    h.update(repr(("id", id(value), len(value))).encode())
    if data is not None:
        _sample_into(h, data, budget)
    return h.hexdigest()


def _sample_into(h, data, budget: list[int]) -> None:  # noqa: ANN001
    n = len(data)
    if n < SAMPLE_BLOCKS * SAMPLE_BLOCK or budget[0] < SAMPLE_BLOCKS * SAMPLE_BLOCK:
        return
    budget[0] -= SAMPLE_BLOCKS * SAMPLE_BLOCK
    step = (n - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
    for i in range(SAMPLE_BLOCKS):
        h.update(data[i * step:i * step + SAMPLE_BLOCK])


def _array_fp(a, t: type, libs: _Libraries, budget: list[int]) -> str:  # noqa: ANN001
    np = libs.np
    head = (a.dtype.str, a.shape)
    if a.dtype.hasobject:
        if a.size <= MAX_ELEMENTS:
            return _digest(t, *head, "objects", *map(_element, a.ravel(order="K").tolist()))
        return _digest(t, *head, "id", id(a))
    if a.flags.c_contiguous or a.flags.f_contiguous:
        flat = a.reshape(-1, order="A").view(np.uint8)
    elif a.nbytes <= FULL_HASH_BYTES and a.nbytes <= budget[0]:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    else:
        return _digest(t, *head, "id", id(a), a.__array_interface__["data"][0], a.strides)
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((t.__module__, t.__qualname__, *head)).encode())
    n = flat.nbytes
    if n <= FULL_HASH_BYTES and n <= budget[0]:
        budget[0] -= n
        h.update(b"content\0")
        h.update(flat)
    else:
        h.update(repr(("id", id(a), a.__array_interface__["data"][0], a.strides)).encode())
        _sample_into(h, flat, budget)
    return h.hexdigest()


def _object_size(value: object, t: type) -> int:
    """``sys.getsizeof``, unless ``__sizeof__`` is Python code of the user's (not run)."""
    for klass in t.__mro__:
        sizeof = vars(klass).get("__sizeof__")
        if sizeof is not None:
            if isinstance(sizeof, types.FunctionType):
                return object.__sizeof__(value)
            break
    try:
        return sys.getsizeof(value)
    except Exception:
        return object.__sizeof__(value)
