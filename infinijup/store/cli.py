"""Command line for the store: ``infinijup store ...`` / ``python -m infinijup.store``.

Exit status: 0 success, 1 ``check`` found a problem, 2 an error (one line on stderr).

Remote-only commits (their chunks evicted to a remote, remote_only.py) are listed as usual:
``log`` ends their line with ``[remote-only]`` (``"remote_only": true`` with ``--json``),
``show`` says where their data is, ``check`` counts them (not a problem), ``stats`` too;
``pull REMOTE ID`` brings one back.

Getting space back (space.py has the rules): ``rm ID`` deletes a snapshot that no other
snapshot builds on (each thread ending at it moves back to its parent; a thread with nothing
left goes), ``thread-rm NAME`` deletes a thread and the snapshots only it reaches. Both refuse
what a hibernated kernel sleeps in (the records beside the store, ``<store>-hibernated/``), run
gc, and drop the hot tier's copies of the snapshots that left the store. A running kernel's
HEAD is known only to its server: delete from the panel (or stop the server) when kernels run.
``stats`` shows the store's size and the hot tier's. The hot tier is ``$INFINIJUP_HOT_TIER``, or
``hot/`` in this user's directory of the helper's work dir (``--hot-tier`` to name it).

Remotes are encrypted (remote_repo.py, keys.py): ``key init REMOTE`` makes an empty one
encrypted, ``key add|list|remove|passwd REMOTE`` manage its key slots. ``init --encrypt``
makes a local store encrypted at rest (local_crypto.py); ``key add|list|remove|passwd PATH``
manage its slots, and every command opens it with ``$INFINIJUP_STORE_PASSWORD_FILE`` /
``$INFINIJUP_STORE_KEY_FILE``. The key comes from
``--password-file`` / ``--key-file``, else ``$INFINIJUP_STORE_PASSWORD_FILE`` /
``$INFINIJUP_STORE_KEY_FILE``, else a prompt when stdin is a terminal. ``push`` to a remote
without encryption needs ``--unencrypted`` (or ``$INFINIJUP_REMOTE_UNENCRYPTED=1``).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infinijup.errors import InfinijupError

from . import hot_dir
from .check import check
from .errors import RemoteKeyError, RemoteKeyRequired
from .gc import gc
from .keys import KEY_FILE_ENV, PASSWORD_FILE_ENV, UNENCRYPTED_ENV, Credentials
from .objects import Commit
from .rebuild import rebuild_index
from .remote_only import remote_only
from .repository import Repository, default_store_path
from .space import delete, format_bytes, plan_commit_delete, plan_thread_delete, store_bytes

# The helper's default work dir (infinijup_helper/config.py), for finding the hot tier without
# asking the helper; $INFINIJUP_HOT_TIER or --hot-tier name another.
_HELPER_WORK = "/var/lib/infinijup/work"


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``store`` subcommand (with its sub-subcommands) on ``subparsers``."""
    p = subparsers.add_parser("store", help="inspect and maintain the snapshot store",
                              description="Inspect and maintain the snapshot store.")
    _configure(p)
    return p


_STORE_HELP = "store directory (default: $INFINIJUP_STORE or ~/.local/share/infinijup/store)"


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="PATH", default=None, help=_STORE_HELP)
    # ``--store`` is accepted after the command too (``store check --store PATH``); there it
    # overrides the one before the command only when given (SUPPRESS: no default to clobber).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", metavar="PATH", default=argparse.SUPPRESS, help=_STORE_HELP)
    sub = p.add_subparsers(dest="store_command", metavar="COMMAND")
    sub.required = True
    init = sub.add_parser("init", parents=[common], help="create a store",
                          description="Create an empty store. With --encrypt it is encrypted "
                                      "at rest: its first key slot is opened by the password "
                                      "or key file given, and every process that opens the "
                                      "store needs one of its keys "
                                      f"(${PASSWORD_FILE_ENV} or ${KEY_FILE_ENV}).")
    init.add_argument("--encrypt", action="store_true",
                      help="encrypt the store at rest (keyed ids; sealed objects, commits, "
                           "refs; the index holds no plaintext)")
    init.add_argument("--password-file", metavar="FILE", default=None,
                      help=f"the store's password, in a file (default: ${PASSWORD_FILE_ENV})")
    init.add_argument("--key-file", metavar="FILE", default=None,
                      help=f"a key file (created if absent; default: ${KEY_FILE_ENV})")
    log = sub.add_parser("log", parents=[common], help="list commits, newest first")
    log.add_argument("--thread", help="only ancestors of this thread's tip")
    log.add_argument("--json", action="store_true", help="one JSON object per line")
    sub.add_parser("threads", parents=[common], help="list threads and their tips")
    show = sub.add_parser("show", parents=[common], help="show one commit and its files")
    show.add_argument("ref", help="commit id, unique prefix (>= 8 hex) or thread name")
    check = sub.add_parser("check", parents=[common],
                           help="verify the store (exit 1 on a problem)")
    check.add_argument("--read-data", action="store_true", help="re-hash every stored object")
    hot = argparse.ArgumentParser(add_help=False)
    hot.add_argument("--hot-tier", metavar="DIR", default=None,
                     help="the hot tier (default: $INFINIJUP_HOT_TIER, else hot/ in this "
                          "user's directory of the helper's work dir)")
    gc = sub.add_parser("gc", parents=[common, hot],
                        help="remove what no thread reaches (hibernated kernels' snapshots "
                             "stay) and the hot copies of what left the store")
    gc.add_argument("--dry-run", action="store_true", help="only report what would go")
    rm = sub.add_parser(
        "rm", parents=[common, hot], help="delete a snapshot and get its space back",
        description="Delete a snapshot that no other snapshot builds on: each thread ending "
                    "at it moves back to its parent (a thread with nothing left is removed). "
                    "Refused, with the reason, for a snapshot others build on (delete from the "
                    "tip, or delete the thread) and for one a hibernated kernel sleeps in. "
                    "Then gc, and the hot copies of what left the store are dropped. Copies "
                    "pushed to a remote stay there.")
    rm.add_argument("commit", help="snapshot id or unique prefix (>= 8 hex)")
    rm.add_argument("--no-gc", action="store_true",
                    help="only move the threads (the next gc reclaims the space)")
    thread_rm = sub.add_parser(
        "thread-rm", parents=[common, hot], help="delete a thread and get its space back",
        description="Delete a thread: its ref, and the snapshots no other thread reaches. "
                    "Refused for a thread holding a snapshot a hibernated kernel sleeps in. "
                    "Then gc, and the hot copies of what left the store are dropped.")
    thread_rm.add_argument("thread", help="the thread's name as `threads` lists it")
    thread_rm.add_argument("--no-gc", action="store_true",
                           help="only remove the ref (the next gc reclaims the space)")
    sub.add_parser("stats", parents=[common, hot],
                   help="sizes and counts (the store's and the hot tier's size first)")
    sub.add_parser("rebuild-index", parents=[common],
                   help="rebuild the index from packs and commits")
    key = argparse.ArgumentParser(add_help=False)
    key.add_argument("--password-file", metavar="FILE", default=None,
                     help=f"the remote's password, in a file (default: ${PASSWORD_FILE_ENV})")
    key.add_argument("--key-file", metavar="FILE", default=None,
                     help=f"the remote's key file (default: ${KEY_FILE_ENV})")
    clear = argparse.ArgumentParser(add_help=False)
    clear.add_argument("--unencrypted", action="store_true", default=None,
                       help="allow a remote without encryption: whoever can read the bucket "
                            f"reads the snapshots (default: ${UNENCRYPTED_ENV}=1)")
    push = sub.add_parser("push", parents=[common, key, clear],
                          help="send threads to a remote store (s3://bucket/prefix)")
    push.add_argument("remote", help="s3://bucket/prefix (endpoint: $INFINIJUP_S3_ENDPOINT)")
    push.add_argument("threads", nargs="*", help="threads to push (default: all)")
    pull = sub.add_parser("pull", parents=[common, key, clear],
                          help="fetch a thread or commit (and its history) from a remote")
    pull.add_argument("remote", help="s3://bucket/prefix")
    pull.add_argument("ref", help="a thread of the remote, or a full commit id")
    clone = sub.add_parser("clone", parents=[common, key, clear],
                           help="create a store from every thread of a remote")
    clone.add_argument("remote", help="s3://bucket/prefix")
    clone.add_argument("path", nargs="?", help="new store (default: --store or the default)")
    keys = sub.add_parser("key", help="the keys of an encrypted remote or local store",
                          description="Manage the key slots of an encrypted remote "
                                      "(s3://...) or local store (a path): each slot (a "
                                      "password or a key file) opens the same master key. "
                                      "Lose them all and the data cannot be read.")
    ksub = keys.add_subparsers(dest="key_command", metavar="KEY_COMMAND")
    ksub.required = True
    new = argparse.ArgumentParser(add_help=False)
    new.add_argument("--new-password-file", metavar="FILE", default=None,
                     help="the new slot's password, in a file (default: prompt)")
    new.add_argument("--new-key-file", metavar="FILE", default=None,
                     help="a key file for the new slot (created if absent)")
    new.add_argument("--label", default="", help="a note shown by `key list` (stored in "
                                                 "the clear)")
    init = ksub.add_parser("init", parents=[key],
                           help="make an empty remote encrypted (its first key slot)")
    init.add_argument("remote", help="s3://bucket/prefix")
    init.add_argument("--label", default="", help="a note shown by `key list` (in the clear)")
    for name, what in (("add", "add a key slot"), ("passwd", "replace the slot that opens "
                                                             "the remote by a new one")):
        k = ksub.add_parser(name, parents=[key, new], help=what)
        k.add_argument("remote", help="s3://bucket/prefix")
    k = ksub.add_parser("list", parents=[key], help="list the key slots")
    k.add_argument("remote", help="s3://bucket/prefix")
    k = ksub.add_parser("remove", parents=[key],
                        help="remove a key slot (not the one used, not the last)")
    k.add_argument("remote", help="s3://bucket/prefix")
    k.add_argument("slot", help="the slot's id, as `key list` shows it")
    p.set_defaults(func=run)  # what ``infinijup``'s main calls for ``infinijup store ...``


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``store`` command; returns the exit status."""
    path = args.store or default_store_path()
    try:
        if args.store_command == "clone":
            return _clone(args.remote, args.path or path, args)
        if args.store_command == "key":
            return _key(args)
        if args.store_command == "init":
            return _init(path, args)
        repo = Repository.open(path)
        try:
            return _COMMANDS[args.store_command](repo, args)
        finally:
            repo.close()
    except InfinijupError as exc:
        print(f"infinijup store: error: {exc} [{exc.reason}]", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m infinijup.store``."""
    parser = argparse.ArgumentParser(prog="python -m infinijup.store",
                                     description="Inspect and maintain the snapshot store.")
    _configure(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except BrokenPipeError:
        return 0


def _fmt_time(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _commit_line(c: Commit, remote: bool = False) -> str:
    s = c.stats
    return (f"{c.short_id}  {_fmt_time(c.created)}  {c.thread:<16}  "
            f"{_human(s.get('image_bytes', 0)):>10} image  "
            f"{_human(s.get('stored_bytes', 0)):>10} new  {c.message}"
            + ("  [remote-only]" if remote else ""))


def _log(repo: Repository, args: argparse.Namespace) -> int:
    elsewhere = remote_only(repo)
    for c in repo.log(args.thread):
        if args.json:
            print(json.dumps({"id": c.id, **c.to_json(), "remote_only": c.id in elsewhere},
                             sort_keys=True))
        else:
            print(_commit_line(c, c.id in elsewhere))
    return 0


def _threads(repo: Repository, args: argparse.Namespace) -> int:
    for name, tip in repo.threads().items():
        print(f"{name}\t{tip[:12]}")
    return 0


def shown_metadata(metadata: dict | None) -> dict:
    """A commit's metadata as printed: the kernel's message key (``connection.key``) is
    never shown; that it is recorded is."""
    meta = dict(metadata or {})
    if isinstance(meta.get("connection"), dict) and "key" in meta["connection"]:
        meta["connection"] = {**meta["connection"], "key": "(recorded, not shown)"}
    return meta


def _show(repo: Repository, args: argparse.Namespace) -> int:
    c = repo.get_commit(args.ref)
    print(f"commit   {c.id}")
    print(f"thread   {c.thread}")
    print(f"parents  {' '.join(c.parents) or '-'}")
    print(f"created  {_fmt_time(c.created)}")
    print(f"tree     {c.tree}")
    print(f"message  {c.message}")
    print(f"metadata {json.dumps(shown_metadata(c.metadata), sort_keys=True)}")
    print(f"stats    {json.dumps(c.stats, sort_keys=True)}")
    where = remote_only(repo).get(c.id)
    print(f"data     {f'remote-only, on {where} (a restore or pull brings it back)' if where else 'local'}")
    _print_tree(repo, c.tree, "  ")
    return 0


def _print_tree(repo: Repository, tree_id: str, indent: str) -> None:
    for e in repo.get_tree(tree_id):
        if e.kind == "dir":
            print(f"{indent}{oct(e.mode)[2:]:>5}  {'':>12}  {e.name}/")
            _print_tree(repo, e.id, indent + "  ")
        elif e.kind == "file":
            print(f"{indent}{oct(e.mode)[2:]:>5}  {e.size:>12}  {e.name}")
        else:
            print(f"{indent}{'link':>5}  {'':>12}  {e.name} -> {e.target}")


def _check(repo: Repository, args: argparse.Namespace) -> int:
    report = check(repo, read_data=args.read_data)
    for w in report.warnings:
        print(f"warning: {w}")
    for p in report.problems:
        print(f"problem: {p}")
    print(f"checked {report.commits} commits, {report.trees} trees, {report.blobs} blobs, "
          f"{report.chunks} chunks in {report.packs} packs"
          + (f" ({report.objects_read} objects re-hashed)" if args.read_data else ""))
    if report.remote_only:
        print(f"{report.remote_only} commit(s) are remote-only: their chunks are on the remote "
              "(not checked here; a pull verifies them)")
    print("ok" if report.ok else f"{len(report.problems)} problem(s) found")
    return 0 if report.ok else 1


def _gc(repo: Repository, args: argparse.Namespace) -> int:
    r = gc(repo, dry_run=args.dry_run, keep=_hibernated(repo))
    verb = "would remove" if r.dry_run else "removed"
    print(f"{verb} {len(r.commits_removed)} commits, {r.objects_removed} objects, "
          f"{len(r.packs_deleted)} packs; repacked {len(r.packs_repacked)} packs; "
          f"{r.leftovers_removed} leftovers; {_human(r.bytes_freed)} freed")
    if not r.dry_run:
        _prune_hot(repo, args)
    return 0


def _rm(repo: Repository, args: argparse.Namespace) -> int:
    needed = _hibernated(repo)
    return _delete(repo, args, plan_commit_delete(repo, args.commit, needed=needed), needed)


def _thread_rm(repo: Repository, args: argparse.Namespace) -> int:
    needed = _hibernated(repo)
    return _delete(repo, args, plan_thread_delete(repo, args.thread, needed=needed), needed)


def _delete(repo: Repository, args: argparse.Namespace, plan: Any, needed: dict) -> int:
    report = delete(repo, plan, needed=needed, collect=not args.no_gc)
    for name, tip in plan.moves.items():
        print(f"thread {name}: " + (f"now at {tip[:12]}" if tip else "removed"))
    print(f"{len(plan.removed)} snapshot(s) no longer reached: "
          + " ".join(c[:12] for c in plan.removed))
    if report.gc is None:
        print("space not reclaimed yet (--no-gc): run `infinijup store gc`")
        return 0
    print(f"store {format_bytes(report.store_bytes_before)} -> "
          f"{format_bytes(report.store_bytes_after)}")
    _prune_hot(repo, args)
    return 0


def _hibernated(repo: Repository) -> dict[str, str]:
    """Commit -> why it stays: the snapshots hibernated kernels sleep in (the server's records
    beside the store, serverext/hibernation.py: ``<store>-hibernated/<kernel id>.json``)."""
    records = repo.path.with_name(repo.path.name + "-hibernated")
    out: dict[str, str] = {}
    for path in sorted(records.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("commit"), str):
            out[record["commit"]] = (f"the snapshot hibernated kernel {record.get('kernel_id')} "
                                     f"({record.get('path')}) sleeps in")
    return out


def _hot_root(args: argparse.Namespace) -> Path:
    explicit = getattr(args, "hot_tier", None) or os.environ.get("INFINIJUP_HOT_TIER")
    if explicit:
        return Path(explicit)
    work = os.environ.get("INFINIJUP_HELPER_WORK") or _HELPER_WORK
    return Path(work) / str(os.getuid()) / "hot"


def _prune_hot(repo: Repository, args: argparse.Namespace) -> None:
    """Drop the hot copies of snapshots that are no longer in the store."""
    root = _hot_root(args)
    try:
        dropped = hot_dir.prune(root, lambda e: e.store != repo.config.id
                                or repo.index.has_commit(e.commit))
    except OSError as exc:
        print(f"hot tier {root}: not pruned ({exc.strerror})")
        return
    if dropped:
        print(f"dropped {len(dropped)} hot cop{'y' if len(dropped) == 1 else 'ies'} "
              f"({format_bytes(sum(e.bytes for e in dropped))}) from {root}")


def _stats(repo: Repository, args: argparse.Namespace) -> int:
    root = _hot_root(args)
    print(f"{'store':<20} {format_bytes(store_bytes(repo))} on disk ({repo.path})")
    try:
        hot = f"{format_bytes(hot_dir.usage(root))} ({len(hot_dir.entries(root))} snapshots, {root})"
    except OSError as exc:
        hot = f"unknown ({root}: {exc.strerror})"
    print(f"{'hot copies':<20} {hot}")
    for k, v in repo.stats().items():
        print(f"{k:<20} {v}")
    known = set(repo.index.commit_ids())
    print(f"{'remote_only':<20} {len(known & set(remote_only(repo)))}")
    return 0


def _rebuild(repo: Repository, args: argparse.Namespace) -> int:
    r = rebuild_index(repo)
    print(f"indexed {r['packs']} packs ({r['objects']} objects) and {r['commits']} commits; "
          f"skipped {r['skipped_packs']} damaged packs, {r['skipped_commits']} damaged commits")
    return 0


def _creds(args: argparse.Namespace, *, prompt: bool = False) -> Credentials:
    """The key from the options, else the environment; with ``prompt``, else a password
    typed at the terminal (when there is one)."""
    env = Credentials.from_env()
    password_file = getattr(args, "password_file", None)
    key_file = getattr(args, "key_file", None)
    unencrypted = bool(getattr(args, "unencrypted", None)) or env.unencrypted
    if password_file or key_file:
        return Credentials.build(password_file=password_file, key_file=key_file,
                                 unencrypted=unencrypted)
    if env.has_key or not prompt or not sys.stdin.isatty():
        return Credentials(env.password, env.key_file, unencrypted)
    return Credentials(_ask(f"password for {args.remote}: "), None, unencrypted)


def _ask(question: str, twice: bool = False) -> bytes:
    text = getpass.getpass(question)
    if twice and getpass.getpass("again: ") != text:
        raise RemoteKeyError("the two passwords differ")
    if not text:
        raise RemoteKeyError("an empty password is not a key")
    return text.encode()


def _open(args: argparse.Namespace) -> Any:
    """The remote of ``args``, opened (asking for a password if it needs one and none was
    given, at a terminal)."""
    from .remote_repo import open_remote
    try:
        return open_remote(args.remote, _creds(args))
    except RemoteKeyRequired:
        if not sys.stdin.isatty():
            raise
        return open_remote(args.remote, _creds(args, prompt=True))


def _push(repo: Repository, args: argparse.Namespace) -> int:
    from .remote import push
    remote = _open(args)
    remote.check_push_allowed()
    if not remote.encrypted:
        print(f"warning: pushing to {remote.url} WITHOUT encryption (--unencrypted): whoever "
              "can read the bucket can read these snapshots, the kernels' memory included",
              file=sys.stderr)
    r = push(repo, remote, args.threads)
    print(f"uploaded {r.packs_uploaded} packs ({_human(r.bytes_uploaded)}, "
          f"{r.bytes_uploaded} bytes), {r.commits_uploaded} commits; "
          f"{r.packs_present} needed packs were there already")
    for name, tip in r.threads.items():
        print(f"{name}\t{tip[:12]}")
    return 0


def _pull(repo: Repository, args: argparse.Namespace) -> int:
    from .remote import pull
    _print_pull(pull(repo, _open(args), args.ref))
    return 0


def _clone(remote: str, path: Any, args: argparse.Namespace) -> int:
    from .remote import clone
    repo, reports = clone(_open(args), path)
    repo.close()
    for r in reports:
        _print_pull(r)
    return 0


def _print_pull(r: Any) -> None:
    print(f"pulled {r.commit[:12]}: downloaded {r.packs_downloaded} packs "
          f"({_human(r.bytes_downloaded)}, {r.bytes_downloaded} bytes), kept "
          f"{r.packs_resumed} from an interrupted pull, {r.commits_fetched} commits"
          + (f"; thread {r.thread} -> {r.commit[:12]}" if r.thread else ""))


def _init(path: Any, args: argparse.Namespace) -> int:
    if not args.encrypt:
        if args.password_file or args.key_file:
            raise RemoteKeyError("a password or key file is for --encrypt")
        Repository.init(path).close()
        print(f"created a store at {path}")
        return 0
    creds = _creds(args)
    if not creds.has_key:
        if not sys.stdin.isatty():
            raise RemoteKeyError("give the store's first key: --password-file or --key-file "
                                 f"(or ${PASSWORD_FILE_ENV} / ${KEY_FILE_ENV})")
        creds = Credentials(_ask("new password: ", twice=True))
    Repository.init(path, encrypt=creds).close()
    print(f"created an encrypted store at {path}. Keep its password or key file: without "
          "one, its snapshots cannot be read by anyone")
    return 0


def _new_creds(args: argparse.Namespace) -> Credentials:
    if args.new_password_file or args.new_key_file:
        return Credentials.build(password_file=args.new_password_file,
                                 key_file=args.new_key_file)
    if not sys.stdin.isatty():
        raise RemoteKeyError("give the new key: --new-password-file or --new-key-file")
    return Credentials(_ask("new password: ", twice=True))


def _key(args: argparse.Namespace) -> int:
    from . import keys
    from .s3 import S3Bucket

    cmd = args.key_command
    if "://" not in args.remote:
        return _local_key(args)
    if cmd == "init":
        creds = _creds(args)
        if not creds.has_key:
            if not sys.stdin.isatty():
                raise RemoteKeyError("give the first key: --password-file or --key-file "
                                     f"(or ${PASSWORD_FILE_ENV} / ${KEY_FILE_ENV})")
            creds = Credentials(_ask("new password: ", twice=True))
        bucket = S3Bucket(args.remote)
        bucket.check_bucket()
        opened = keys.init_remote(bucket, creds, label=args.label)
        print(f"{bucket.url} is encrypted now (repository {opened.repo_id}); key slot "
              f"{opened.slot} opens it. Keep the password or key file: without one, the "
              "data pushed there cannot be read by anyone")
        return 0
    remote = _open(args)
    if not remote.encrypted:
        raise RemoteKeyError(f"{remote.url} is not encrypted: it has no keys")
    opened = remote.unlocked
    if cmd == "list":
        for s in keys.list_slots(remote.bucket):
            mark = "*" if s.id == opened.slot else " "
            print(f"{mark} {s.id}  {s.type:<8}  {_fmt_time(s.created)}  {s.label}")
    elif cmd == "add":
        slot = keys.add_slot(remote.bucket, opened.master, bytes.fromhex(opened.repo_id),
                             _new_creds(args), label=args.label)
        print(f"added key slot {slot}")
    elif cmd == "passwd":
        slot = keys.change_password(remote.bucket, opened, _new_creds(args), label=args.label)
        print(f"key slot {opened.slot} replaced by {slot}")
    else:
        keys.remove_slot(remote.bucket, args.slot, opened.slot)
        print(f"removed key slot {args.slot}")
    return 0


def _local_key(args: argparse.Namespace) -> int:
    """``key list|add|passwd|remove PATH``: the key slots of an encrypted local store."""
    from . import local_crypto

    root = Path(args.remote)
    if args.key_command == "init":
        raise RemoteKeyError(f"{root}: a local store is encrypted when it is made "
                             "(`store init --encrypt`), not afterwards")
    opened = local_crypto.open_keys(root, _creds(args))
    if args.key_command == "list":
        for s in local_crypto.list_keys(root):
            mark = "*" if s.id == opened.slot else " "
            print(f"{mark} {s.id}  {s.type:<8}  {_fmt_time(s.created)}  {s.label}")
    elif args.key_command == "add":
        slot = local_crypto.add_key(root, opened, _new_creds(args), label=args.label)
        print(f"added key slot {slot}")
    elif args.key_command == "passwd":
        slot = local_crypto.change_password(root, opened, _new_creds(args), label=args.label)
        print(f"key slot {opened.slot} replaced by {slot}")
    else:
        local_crypto.remove_key(root, args.slot, opened)
        print(f"removed key slot {args.slot}")
    return 0


_COMMANDS = {"log": _log, "threads": _threads, "show": _show, "check": _check, "gc": _gc,
             "rm": _rm, "thread-rm": _thread_rm, "stats": _stats, "rebuild-index": _rebuild, "push": _push, "pull": _pull}
