"""``python -m infinijup_helper [--socket PATH] [--work DIR] [--criu PATH] [--pycriu DIR]
[--daemon --pidfile PATH --log PATH] [limits...]``: run the privileged helper (as root).

Limits (see limits.py and docs/security.md): ``--criu-timeout S`` (the CRIU watchdog's base),
``--max-trees-per-user N``, ``--max-connections-per-user N``, ``--max-ops-per-user N``,
``--max-connections N``, ``--request-timeout S``, ``--idle-timeout S``,
``--kernel-rlimit NAME=SOFT:HARD`` (repeatable; caps on top of the caller's own limits, e.g.
``RLIMIT_NPROC=512:512``; ``-1`` is unlimited). ``--gpu-arena auto|always|never`` and
``--gpu-arena-quota SIZE`` (each user's GPU arena tmpfs: bytes, k/m/g/t, or a percentage of
the RAM; see arena.py)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from .arena import DEFAULT_QUOTA, parse_quota
from .config import (
    HelperConfig,
    default_criu,
    default_nsinit_python,
    default_pycriu,
    default_socket,
    default_work,
)
from .daemon import (
    Ready,
    acquire_instance_lock,
    daemonize,
    read_pidfile,
    remove_pidfile,
    running_instance,
    write_pidfile,
)
from .limits import Limits

log = logging.getLogger("infinijup_helper")

NEEDS_ROOT = (
    "infinijup-helper must run as root: it checkpoints and restores processes with CRIU "
    "(CAP_SYS_ADMIN, CAP_CHECKPOINT_RESTORE, ptrace of other users' processes), creates PID "
    "namespaces, and starts kernels as the calling user. Start it with: sudo make helper"
)


def parse_args(argv: list[str] | None) -> HelperConfig:
    parser = argparse.ArgumentParser(prog="python -m infinijup_helper", description=__doc__)
    parser.add_argument("--socket", default=default_socket(), help="unix socket to serve")
    parser.add_argument("--work", default=default_work(), help="root of the callers' work dirs")
    parser.add_argument("--criu", default=default_criu(), help="CRIU binary (4.2 or newer)")
    parser.add_argument("--pycriu", default=default_pycriu(), help="directory holding pycriu")
    parser.add_argument("--pid-namespace", choices=("auto", "always", "never"), default="auto",
                        help="kernels in their own PID namespace (auto: unless CUDA is usable)")
    parser.add_argument("--daemon", action="store_true", help="detach; return once serving")
    parser.add_argument("--pidfile", help="write the helper's pid here")
    parser.add_argument("--log", help="log file (with --daemon; default: discard)")
    parser.add_argument("--nsinit-python", default=default_nsinit_python(),
                        help="interpreter of every tree's init (every user must be able to run "
                             "it, only root to change it)")
    defaults = Limits()
    parser.add_argument("--criu-timeout", type=float, default=300.0,
                        help="CRIU watchdog: seconds per run, plus 1 s per 16 MiB moved")
    parser.add_argument("--max-trees-per-user", type=int, default=defaults.trees_per_user)
    parser.add_argument("--max-connections-per-user", type=int,
                        default=defaults.connections_per_user)
    parser.add_argument("--max-ops-per-user", type=int, default=defaults.ops_per_user)
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections)
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s,
                        help="seconds for a request line to arrive whole")
    parser.add_argument("--idle-timeout", type=float, default=defaults.idle_timeout_s,
                        help="seconds a connection may wait between requests")
    parser.add_argument("--gpu-arena", choices=("auto", "always", "never"), default="auto",
                        help="mount a tmpfs with huge pages for kernels' GPU segments beside "
                             "the socket (auto: where CUDA is usable)")
    parser.add_argument("--gpu-arena-quota", type=_quota, default=DEFAULT_QUOTA, metavar="SIZE",
                        help="each user's GPU arena (a tmpfs of their own): bytes, with a k, m, "
                             "g or t suffix, or a percentage of the RAM (default: %(default)s)")
    parser.add_argument("--cgroup", choices=("caller", "none"), default="caller",
                        help="kernels join the cgroup (v2) of the process that asked for them")
    parser.add_argument("--kernel-rlimit", action="append", default=[], metavar="NAME=SOFT:HARD",
                        help="cap a kernel's resource limit below the caller's own")
    ns = parser.parse_args(argv)
    if not ns.criu:
        parser.error(
            "no CRIU found (INFINIJUP_CRIU, /opt/infinijup/criu, PATH); run: sudo make criu"
        )
    return HelperConfig(
        socket_path=os.path.abspath(ns.socket),
        work_dir=os.path.abspath(ns.work),
        criu_binary=ns.criu,
        pycriu_path=ns.pycriu,
        daemon=ns.daemon,
        pidfile=os.path.abspath(ns.pidfile) if ns.pidfile else None,
        log_path=os.path.abspath(ns.log) if ns.log else None,
        pid_namespace={"auto": None, "always": True, "never": False}[ns.pid_namespace],
        nsinit_python=ns.nsinit_python,
        criu_timeout_s=ns.criu_timeout,
        cgroup=ns.cgroup,
        gpu_arena=ns.gpu_arena,
        gpu_arena_quota=ns.gpu_arena_quota,
        limits=Limits(
            max_connections=ns.max_connections,
            connections_per_user=ns.max_connections_per_user,
            ops_per_user=ns.max_ops_per_user,
            trees_per_user=ns.max_trees_per_user,
            idle_timeout_s=ns.idle_timeout,
            request_timeout_s=ns.request_timeout,
            rlimit_caps=_rlimit_caps(parser, ns.kernel_rlimit),
        ),
    )


def _quota(text: str) -> str:
    try:
        return parse_quota(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rlimit_caps(parser: argparse.ArgumentParser, specs: list[str]) -> dict[str, tuple[int, int]]:
    from .limits import PROC_LIMIT_NAMES

    caps = {}
    for spec in specs:
        name, _, values = spec.partition("=")
        soft, _, hard = values.partition(":")
        try:
            caps[name] = (int(soft), int(hard or soft))
        except ValueError:
            parser.error(f"--kernel-rlimit {spec!r}: expected NAME=SOFT:HARD")
        if name not in PROC_LIMIT_NAMES:
            parser.error(f"--kernel-rlimit {spec!r}: unknown {name}; one of {sorted(PROC_LIMIT_NAMES)}")
    return caps


def serve(config: HelperConfig, ready: Ready) -> int:
    """Set everything up, report readiness, serve until SIGTERM/SIGINT."""
    # Imported here so `--help` and the non-root refusal work without pycriu or protobuf.
    from .arena import Arena
    from .criu import Criu, CriuSettings
    from .ops import Features, Operations
    from .paths import WorkDirs
    from .reaper import Reaper, become_subreaper
    from .registry import REGISTRY_SUFFIX, Registry
    from .seal import Sealer
    from .server import HelperServer

    lock_fd = acquire_instance_lock(config)
    if lock_fd is None:
        pid = read_pidfile(config.pidfile)
        ready(f"running pid {pid}" if pid else f"running ({config.lock_path} is locked)")
        return 0
    try:
        become_subreaper()
        work = WorkDirs(config.work_dir)
        work.prepare(os.path.join(os.path.dirname(os.path.abspath(__file__)), "nsinit.py"))
        criu = Criu(CriuSettings(config.criu_binary, config.pycriu_path,
                                 timeout_s=config.criu_timeout_s))
        registry = Registry(config.socket_path + REGISTRY_SUFFIX)
        reaper = Reaper(registry)
        features = Features.detect()
        ops = Operations(work, criu, registry, Sealer(os.path.join(work.root, ".seal-key")),
                         python=config.nsinit_python,
                         features=features,
                         pid_namespace=config.pid_namespace,
                         limits=config.limits,
                         cgroup=config.cgroup)
        server = HelperServer(config.socket_path, ops)
        server.bind()  # checks the socket's directory: the GPU arena goes there too
        registry.load()  # beside the socket: its directory was checked by bind()
        if {"always": True, "never": False}.get(config.gpu_arena, features.cuda):
            ops.arena = Arena.mount(config.socket_path, config.gpu_arena_quota)
        if ops.arena is not None:  # what no live kernel needs goes (arena.py)
            ops.arena.sweep(t.owner for t in registry.owned_by(None))
        reaper.on_ended = ops.tree_ended
    except Exception as exc:  # noqa: BLE001 - say why we could not start, then exit
        log.exception("cannot start")
        ready(f"{type(exc).__name__}: {exc}")
        return 1
    reaper.start()
    if config.pidfile:
        write_pidfile(config.pidfile)

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping (kernels keep running)", signum)
        server.shutdown()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    log.info(
        "infinijup helper %d ready: socket %s, work %s, CRIU %s %s",
        os.getpid(),
        config.socket_path,
        work.root,
        config.criu_binary,
        criu.version,
    )
    ready(None)
    try:
        server.serve_forever()
    finally:
        reaper.stop()
        remove_pidfile(config.pidfile)
        os.close(lock_fd)
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    if os.geteuid() != 0:
        print(NEEDS_ROOT, file=sys.stderr)
        return 1
    running = running_instance(config)
    if running:
        print(f"infinijup helper already running ({running})")
        return 0
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if config.daemon:
        return daemonize(config, serve)

    def ready(error: str | None) -> None:
        if error is not None and not error.startswith("running"):
            print(f"infinijup helper failed to start: {error}", file=sys.stderr)
        elif error is not None:
            print(f"infinijup helper already running ({error[8:]})")

    return serve(config, ready)


if __name__ == "__main__":
    sys.exit(main())
