"""A model split over several GPUs against the same model on one (issue 33), side by side in
one run, through a real Jupyter server, the helper and CRIU.

The notebook builds a Llama-shaped model with random bf16 weights (``--shape``: about 27 GB
for "13b"), on one card or split layer by layer over ``N`` cards with accelerate's
``dispatch_model`` (what ``device_map="auto"`` does), and fills a KV cache with a forward pass
over ``batch x context`` tokens. Then: a snapshot (pause, the segments' way out, a next cell
sent while the kernel is held), ``--changes`` snapshots after one MLP changed on the first and
the last card, ``--restores`` restores of the newest to the first answer (hot tier) and a
resume of it into a new kernel (``--repeat``: as many of both), each checked by sampled
generation in deterministic mode (the draw must be the one made after that snapshot).

    python3 bench/multi_gpu_bench.py --gpus 1 2            # on nvidia-h100-x2, ~8 minutes

Prints a JSON line per row, then a table with the ratios of each row to the one-GPU row.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchkit import GB, execute, make_base, start_helper, start_server, transposed_table
from gpu_bench import PARTS_LABEL, restore_timed, segment_parts, snapshot_with_next_cell

SHAPES = {  # hidden, intermediate, layers, heads, kv heads
    "tiny": (512, 1376, 4, 8, 8),
    "3b": (3072, 8192, 28, 24, 8),
    "8b": (4096, 14336, 32, 32, 8),
    "13b": (5120, 13824, 48, 40, 8),
}

BUILD = """
import os, time, torch
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
torch.use_deterministic_algorithms(True)
from transformers import LlamaConfig, LlamaForCausalLM
_t = time.perf_counter()
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size={hidden}, intermediate_size={inter}, num_hidden_layers={layers},
                  num_attention_heads={heads}, num_key_value_heads={kv}, vocab_size=32000,
                  max_position_embeddings=8192)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda:0"):
    model = LlamaForCausalLM(cfg).eval()
torch.set_default_dtype(torch.float32)
GPUS = {gpus}
if GPUS > 1:
    from accelerate import dispatch_model
    n = cfg.num_hidden_layers
    split = {{"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": GPUS - 1,
              "lm_head": GPUS - 1}}
    split.update({{f"model.layers.{{i}}": i * GPUS // n for i in range(n)}})
    model = dispatch_model(model, device_map=split)
torch.cuda.empty_cache()
prompt = torch.randint(0, 32000, ({batch}, {context}), device="cuda:0")
with torch.no_grad():
    cache = model(prompt, use_cache=True, logits_to_keep=1).past_key_values
def sample():
    torch.manual_seed(11)
    with torch.no_grad():
        out = model.generate(prompt[:2, -32:], do_sample=True, max_new_tokens=16, top_k=50,
                             pad_token_id=0)
    return out[:, -16:].tolist()
for _d in range(GPUS):
    torch.cuda.synchronize(_d)
build_s = time.perf_counter() - _t
cards = sorted({{p.device.index for p in model.parameters()}})
live = [torch.cuda.memory_allocated(d) for d in range(GPUS)]
"""
CHANGE = ("with torch.no_grad():\n"
          "    for _l in (model.model.layers[0], model.model.layers[-1]):\n"
          "        _l.mlp.down_proj.weight.add_(1e-3)")
NEXT_CELL = "[torch.cuda.synchronize(d) for d in range(GPUS)]; next_cell = 1"


def log(what: str) -> None:
    """A line of progress on stderr, with the time (a row takes minutes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def pause_phases(server, kernel_id: str, commit: str) -> str:  # noqa: ANN001
    """The helper's phases of the commit's pause (its metadata's timings)."""
    code, body = server.request("GET", f"/infinijup/history?kernel_id={kernel_id}")
    assert code == 200, body
    meta = next(c for c in body["commits"] if c["id"] == commit)["metadata"]
    return json.dumps({k[len("helper_"):-2]: round(v, 2)
                       for k, v in (meta.get("timings") or {}).items() if k.startswith("helper_")})


def image_parts(store: str, commit: str) -> str:
    """The commit's image by kind: CRIU's page files, the GPU segments file, the rest (GB,
    apparent sizes, as ``image_bytes`` counts them)."""
    from infinijup.gpu import arena as gpu_arena
    from infinijup.store.repository import Repository

    repo = Repository.open(store)
    try:
        tree = repo.get_tree(repo.get_commit(commit).tree)
    finally:
        repo.close()
    parts = {"pages": 0, "segments": 0, "other": 0}
    for e in tree:
        if e.kind != "file":
            continue
        kind = ("pages" if e.name.startswith("pages-") else
                "segments" if e.name == gpu_arena.IMAGE_NAME else "other")
        parts[kind] += e.size
    return " / ".join(f"{k} {v / GB:.2f}" for k, v in parts.items())


def restore_parts(phases: dict) -> str:
    """A restore's timed parts, rounded (the server's steps and the helper's phases)."""
    return " ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in phases.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool))


def row_for(gpus: int, shape: str, batch: int, context: int, changes: int = 1,
            restores: int = 1, resume: bool = True, hot_tier_gb: float = 400) -> dict:
    hidden, inter, layers, heads, kv = SHAPES[shape]
    row: dict = {"run": f"{shape} on {gpus} GPU" + ("s" if gpus > 1 else "") +
                 ("" if hot_tier_gb else ", no hot tier")}
    daemon = start_helper()
    base = make_base()
    store = tempfile.mkdtemp(prefix="ijbench-store-", dir="/var/tmp")
    server = start_server(base, daemon.socket_path, store,
                          {"busy_timeout": 900.0, "answer_timeout": 900.0,
                           "hot_tier_bytes": int(hot_tier_gb * GB)})
    try:
        kernel_id = server.open_session("split.ipynb")
        kernel = server.kernel_client(kernel_id)
        execute(kernel.kc, BUILD.format(hidden=hidden, inter=inter, layers=layers, heads=heads,
                                        kv=kv, gpus=gpus, batch=batch, context=context),
                timeout=1800)
        ev = kernel.evaluate(build="build_s", live="live", cards="cards")
        live = ast.literal_eval(ev["live"])
        row.update(build_s=float(ev["build"]), cards=str(ev["cards"]),
                   live_gb=sum(int(x) for x in live) / GB,
                   live_per_card_gb=" / ".join(f"{int(x) / GB:.1f}" for x in live))

        snap = snapshot_with_next_cell(server, kernel, kernel_id, "split", NEXT_CELL)
        stats = snap["body"]["stats"]
        seg = stats.get("gpu_segments") or {}
        row.update(pause_s=stats["pause_s"], quiesce_s=stats["quiesce_s"],
                   next_cell_s=snap["next_cell_s"], durable_s=snap["durable_s"],
                   segments_gb=seg.get("bytes", 0) / GB, segments_s=seg.get("seconds"),
                   segments_parts=segment_parts(seg), image_gb=stats["image_bytes"] / GB,
                   stored_gb=stats["stored_bytes"] / GB,
                   pause_phases=pause_phases(server, kernel_id, snap["body"]["commit"]),
                   image_parts_gb=image_parts(store, snap["body"]["commit"]))
        log(f"first snapshot: pause {stats['pause_s']:.2f} s, durable {snap['durable_s']:.1f} s "
            f"(store {stats.get('store_s') or 0:.1f} s); image {row['image_parts_gb']} GB")

        # Snapshots after a small change (the pause a user meets most), `changes` of them.
        pauses, durables, stores, hots, reads = [], [], [], [], []
        second = snap
        for i in range(changes):
            execute(kernel.kc, CHANGE, timeout=600)
            second = snapshot_with_next_cell(server, kernel, kernel_id,
                                             f"one MLP per end card ({i + 1})", NEXT_CELL)
            s2 = second["body"]["stats"]
            pauses.append(s2["pause_s"])
            durables.append(second["durable_s"])
            stores.append(s2.get("store_s") or 0)
            hots.append(s2.get("hot_s") or 0)
            reads.append(s2.get("read_bytes", 0) / GB)
            log(f"snapshot after a change {i + 1}: pause {s2['pause_s']:.2f} s, durable "
                f"{second['durable_s']:.1f} s (store {s2.get('store_s') or 0:.1f} s, hot copy "
                f"after it {s2.get('hot_s') or 0:.1f} s, read {reads[-1]:.2f} GB)")
            if i == 0:
                seg2 = s2.get("gpu_segments") or {}
                row.update(second_pause_s=s2["pause_s"], second_quiesce_s=s2["quiesce_s"],
                           second_segments_mb=seg2.get("bytes", 0) / 1e6,
                           second_stored_mb=s2["stored_bytes"] / 1e6)
        if pauses:
            row.update(changed_pauses=" ".join(f"{x:.2f}" for x in pauses),
                       changed_pause_median_s=statistics.median(pauses),
                       changed_pause_phases=pause_phases(server, kernel_id,
                                                         second["body"]["commit"]),
                       changed_durables=" ".join(f"{x:.1f}" for x in durables),
                       changed_durable_median_s=statistics.median(durables),
                       changed_store_hot=" ".join(f"{a:.1f} / {b:.1f}"
                                                  for a, b in zip(stores, hots, strict=True)),
                       changed_read_gb=" ".join(f"{x:.2f}" for x in reads))

        # Restores of the newest snapshot to the first answer, `restores` of them. Its images
        # are the hot tier's newest: the tier gives way to each dump oldest first, and on a
        # disk of 128 GB the first snapshot's were gone after three more 32 GB dumps.
        newest = second["body"]["commit"]
        expect_newest = kernel.evaluate(s="sample()")["s"]
        took = []
        for i in range(restores):
            hot = restore_timed(server, kernel, kernel_id, newest, expect_newest)
            log(f"restore {i + 1}: {hot['s']:.2f} s ({hot['phases'].get('images')}): "
                f"{restore_parts(hot['phases'])}")
            took.append(hot["s"])
            row[f"restore_{i + 1}_parts"] = restore_parts(hot["phases"])
            if i == 0:
                row.update(restore_hot_s=hot["s"], restore_phases=json.dumps(
                    {k: hot["phases"][k] for k in ("images", "restore", "cuda_restore",
                                                   "answer_s") if k in hot["phases"]}))
        row.update(restores=" ".join(f"{x:.2f}" for x in took),
                   restore_median_s=statistics.median(took))
        if not resume:
            row["sampling_equal"] = "after each restore"
            kernel.kc.stop_channels()
            log(f"row: {json.dumps(row)}")  # before the clean-up, which can take minutes
            return row

        kernel.kc.stop_channels()  # the kernel ends: its pids and cards are free again
        code, body = server.request("DELETE", f"/api/kernels/{kernel_id}")
        assert code == 204, body
        t0 = time.perf_counter()
        code, body = server.request("POST", "/infinijup/resume",
                                    {"path": "split.ipynb", "commit": newest}, timeout=3600)
        assert code == 200, body
        other = server.kernel_client(body["kernel_id"])
        row["resume_s"] = time.perf_counter() - t0
        drawn = other.evaluate(s="sample()")["s"]
        assert drawn == expect_newest, f"the resumed kernel drew {drawn}, not {expect_newest}"
        row["sampling_equal"] = "after each restore and the resume"
        other.kc.stop_channels()
        log(f"row: {json.dumps(row)}")
    finally:
        server.stop()
        daemon.stop()
        shutil.rmtree(daemon.base, ignore_errors=True)  # its work dir: dumps, the hot tier
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    return row


METRICS = [("cards", "cards holding the model"), ("live_gb", "live GPU memory (GB)"),
           ("live_per_card_gb", "per card (GB)"), ("build_s", "build (s)"),
           ("pause_s", "pause (s)"), ("quiesce_s", "quiesce (s)"),
           ("pause_phases", "pause phases (s)"), ("next_cell_s", "next cell answered (s)"),
           ("segments_gb", "segments out (GB)"),
           ("segments_s", "segments out (s)"),
           ("segments_parts", f"{PARTS_LABEL} (s)"),
           ("durable_s", "durable commit (s)"), ("image_gb", "image (GB)"),
           ("image_parts_gb", "image: CRIU pages / segments / other (GB)"),
           ("stored_gb", "stored (GB)"), ("second_pause_s", "second snapshot: pause (s)"),
           ("second_segments_mb", "second: segments copied (MB)"),
           ("second_stored_mb", "second: stored (MB)"),
           ("restore_hot_s", "restore to first answer, hot (s)"),
           ("restore_phases", "restore phases"),
           ("changed_pauses", "pauses after a change (s)"),
           ("changed_pause_median_s", "median pause after a change (s)"),
           ("changed_pause_phases", "last pause after a change: phases (s)"),
           ("changed_durables", "durable after a change (s)"),
           ("changed_durable_median_s", "median durable after a change (s)"),
           ("changed_store_hot", "after a change: store / hot copy after it (s)"),
           ("changed_read_gb", "after a change: store read (GB)"),
           ("restores", "restores to first answer, hot (s)"),
           ("restore_median_s", "median restore to first answer (s)"),
           *[(f"restore_{i}_parts", f"restore {i}: parts (s)") for i in range(1, 6)],
           ("resume_s", "resume into a new kernel (s)"),
           ("sampling_equal", "sampled generation equal")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shape", default="13b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1,
                    help="snapshots after a change, and hot restores, per row (medians)")
    ap.add_argument("--changes", type=int, default=None,
                    help="snapshots after a change per row (default: --repeat; 0: none, the "
                         "restores then restore the first snapshot)")
    ap.add_argument("--restores", type=int, default=None,
                    help="hot restores per row (default: --repeat)")
    ap.add_argument("--no-resume", dest="resume", action="store_false",
                    help="leave out the resume into a new kernel")
    ap.add_argument("--hot-tier-gb", type=float, nargs="+", default=[400],
                    help="the server's hot tier, a row for each (0: none; the restores then "
                         "come from the store)")
    args = ap.parse_args()
    changes = args.repeat if args.changes is None else args.changes
    restores = args.repeat if args.restores is None else args.restores
    if args.repeat < 1 or changes < 0 or restores < 1:
        ap.error("--repeat and --restores: at least 1; --changes: at least 0")
    rows = []
    for gpus in args.gpus:
        for hot in args.hot_tier_gb:
            row = row_for(gpus, args.shape, args.batch, args.context, changes, restores,
                          args.resume, hot)
            print(json.dumps(row), flush=True)
            rows.append(row)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().replace("\n", "; ")
    print(f"\nGPUs: {smi}; {time.strftime('%Y-%m-%d')}; one run per row, {changes} "
          f"pause(s) after a change and {restores} hot restore(s) in each\n")
    print(transposed_table(rows, [r["run"] for r in rows], METRICS))
    one = next((r for r in rows if r["run"].endswith("on 1 GPU")), None)
    for r in rows:
        if one is None or r is one:
            continue
        changed = (f"pause after a change "
                   f"{r['changed_pause_median_s'] / one['changed_pause_median_s']:.2f}x, "
                   if "changed_pause_median_s" in r and "changed_pause_median_s" in one else "")
        print(f"\n{r['run']} / {one['run']}: pause {r['pause_s'] / one['pause_s']:.2f}x, "
              f"restore to first answer {r['restore_hot_s'] / one['restore_hot_s']:.2f}x; "
              f"medians: {changed}restore "
              f"{r['restore_median_s'] / one['restore_median_s']:.2f}x (aim: within 1.3x)")


if __name__ == "__main__":
    main()
