"""What a CUDA context itself costs a snapshot, and whether the quiesce can trim it.

Each GPU a kernel touches gets a context, and the driver's checkpoint copies everything the
context holds on the card that no allocator of ours moved out (its code, its local memory for
kernels' stacks, its heaps) into the process's host memory, which CRIU then dumps and restores.
This probe runs a child that uses PyTorch on N cards (matmuls, attention, sort, sampling), frees
every tensor, and then, from this process, checkpoints it with the driver as the helper does:
the child's resident memory before and after, the card memory the context holds, and the time
of the checkpoint and the restore; first as it is, then with each context's stack size set to
``--stack`` (0) for the checkpoint and back after (``cuCtxSetLimit(CU_LIMIT_STACK_SIZE)``, as
kernel_magics/gpu_context.py does), which frees and reallocates the stacks' local memory; and
a kernel needing a 4 KiB stack launched with the limit trimmed. Prints a markdown table.

    python3 bench/gpu_context_probe.py [--gpus 1] [--runs 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

LIMITS = {"stack": 0, "printf_fifo": 1, "malloc_heap": 2}


def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _limits(cuda) -> dict:
    out = {}
    for name, code in LIMITS.items():
        v = ctypes.c_size_t()
        rc = cuda.cuCtxGetLimit(ctypes.byref(v), code)
        out[name] = v.value if rc == 0 else f"rc{rc}"
    return out


def child(gpus: int) -> None:
    import torch

    cuda = _libcuda()
    devs = list(range(gpus))

    def work() -> None:
        for d in devs:
            with torch.cuda.device(d):
                g = torch.Generator(device=f"cuda:{d}").manual_seed(d)
                a = torch.randn(4096, 4096, device=f"cuda:{d}", dtype=torch.bfloat16, generator=g)
                (a @ a).float().sum().item()
                q = torch.randn(4, 32, 2048, 128, device=f"cuda:{d}", dtype=torch.bfloat16,
                                generator=g)
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()
                v = torch.randn(10_000_000, device=f"cuda:{d}", generator=g)
                torch.sort(v)[0][:5].sum().item()
                torch.topk(v, 1000)[0].sum().item()
                p = torch.softmax(torch.randn(4, 32000, device=f"cuda:{d}", generator=g), -1)
                torch.multinomial(p, 1, generator=g).sum().item()
                torch.cumsum(v, 0)[-1].item()
                torch.cuda.synchronize(d)

    deep_fn = torch.cuda.jiterator._create_jit_fn(
        "template <typename T> T deep(T x) { volatile T a[1024]; "
        "for (int i = 0; i < 1024; i++) a[i] = x * i; return a[((int)x) & 1023]; }")

    def deep() -> dict:
        """Needs local memory past any stack size set: the driver must grow it at launch."""
        t0 = time.perf_counter()
        ok = True
        for d in devs:
            x = torch.arange(1 << 20, device=f"cuda:{d}", dtype=torch.float32)
            want = x * (x.int() & 1023).float()
            ok &= bool(torch.equal(deep_fn(x), want))
        return {"deep_ok": ok, "deep_s": time.perf_counter() - t0, "after": report()}

    def report() -> dict:
        rep = {}
        for d in devs:
            torch.cuda.set_device(d)
            free, total = torch.cuda.mem_get_info(d)
            rep[d] = {"ctx_mb": (total - free - torch.cuda.memory_reserved(d)) / 2**20,
                      **_limits(cuda)}
        return rep

    work()
    torch.cuda.empty_cache()
    print(json.dumps({"ready": report()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "stack":  # set every context's stack size: the local memory follows
            t0 = time.perf_counter()
            for d in devs:
                torch.cuda.set_device(d)
                torch.cuda.synchronize(d)
                rc = cuda.cuCtxSetLimit(LIMITS["stack"], ctypes.c_size_t(int(cmd[1])))
                assert rc == 0, rc
            took = time.perf_counter() - t0
            print(json.dumps({"set_s": took, "now": report()}), flush=True)
        elif cmd[0] == "deep":  # a kernel with a 4 KiB stack array, launched now
            print(json.dumps(deep()), flush=True)
        elif cmd[0] == "work":
            t0 = time.perf_counter()
            work()
            torch.cuda.empty_cache()
            print(json.dumps({"work_s": time.perf_counter() - t0, "after": report()}), flush=True)
        elif cmd[0] == "quit":
            return


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cycle(drv, pid: int) -> dict:
    args = drv.CUcheckpointLockArgs()
    args.timeoutMs = 10_000
    rss0 = _rss_mb(pid)
    t0 = time.perf_counter()
    assert int(drv.cuCheckpointProcessLock(pid, args)[0]) == 0
    assert int(drv.cuCheckpointProcessCheckpoint(pid, None)[0]) == 0
    t1 = time.perf_counter()
    rss1 = _rss_mb(pid)
    assert int(drv.cuCheckpointProcessRestore(pid, None)[0]) == 0
    assert int(drv.cuCheckpointProcessUnlock(pid, None)[0]) == 0
    t2 = time.perf_counter()
    return {"checkpoint_s": t1 - t0, "restore_s": t2 - t1, "rss_before_mb": rss0,
            "rss_checkpointed_mb": rss1, "rss_restored_mb": _rss_mb(pid)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stack", type=int, default=0, help="the stack size for the checkpoint")
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        child(a.gpus)
        return
    from cuda.bindings import driver as drv

    drv.cuInit(0)
    p = subprocess.Popen([sys.executable, __file__, "--child", "--gpus", str(a.gpus)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(cmd: str | None) -> dict:
        if cmd:
            p.stdin.write(cmd + "\n")
            p.stdin.flush()
        return json.loads(p.stdout.readline())

    rows = []
    state = ask(None)
    print("as started:", json.dumps(state), file=sys.stderr)
    stack = state["ready"]["0"]["stack"]
    for way in ("as it is", f"stack {a.stack} for the checkpoint, {stack} again after"):
        runs = []
        for _ in range(a.runs):
            trim = set_back = None
            if way != "as it is":
                trim = ask(f"stack {a.stack}")
            r = _cycle(drv, p.pid)
            if way != "as it is":
                set_back = ask(f"stack {stack}")
                r.update(trim_s=trim["set_s"], set_back_s=set_back["set_s"],
                         ctx_trimmed_mb=trim["now"]["0"]["ctx_mb"],
                         ctx_back_mb=set_back["now"]["0"]["ctx_mb"])
            runs.append(r)
        if way != "as it is":
            ask(f"stack {a.stack}")
            print("a deep kernel with the stack trimmed:", json.dumps(ask("deep")),
                  file=sys.stderr)
            ask(f"stack {stack}")
        after = ask("work")
        print(way, "cycles:", json.dumps(runs), file=sys.stderr)
        print(way, "then work:", json.dumps(after), file=sys.stderr)
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append((way, med, after["work_s"]))
    p.stdin.write("quit\n")
    p.stdin.flush()
    p.wait(timeout=60)
    print(f"\n{a.gpus} card(s), medians of {a.runs}, pid {p.pid}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| context | trim | checkpoint | restore | set back | host memory added by the "
          "checkpoint | the next work |")
    print("|---|---|---|---|---|---|---|")
    for way, m, work_s in rows:
        print(f"| {way} | {m.get('trim_s', 0):.3f} s | {m['checkpoint_s']:.3f} s | "
              f"{m['restore_s']:.3f} s | {m.get('set_back_s', 0):.3f} s | "
              f"{m['rss_checkpointed_mb'] - m['rss_before_mb']:.0f} MiB | {work_s:.2f} s |")


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    main()
