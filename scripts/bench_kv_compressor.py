"""What a KakeyaLattice-compressed resident cache costs per decode step, next to the uncompressed one.

Loads the real model (default smollm2-135m-instruct), prefills the same random-id history into one
cache per arm (full / sink_window 4+64, each with and without a compressor), then decodes
`--steps` single-token steps, the arms taking turns step by step so that load on the machine
falls on every arm alike. Per arm and history length it records:

  * decode step time (median over steps) and its ratio to the same strategy uncompressed;
  * per decode step, counted by torch.profiler on one extra step: host<->device synchronisations
    (`aten::_local_scalar_dense` = .item()/bool()/int() of a tensor, `aten::nonzero` = boolean
    indexing / nonzero) and aten op events. The counts do not depend on the machine's load; on
    an accelerator each sync stalls the launch queue and each op is at least one kernel launch,
    so they say what a CPU timing cannot;
  * the cache's kv bytes.

Output: results/bench_kv_compressor.json (+ .png). Example:
    .venv/bin/python scripts/bench_kv_compressor.py --histories 1000,2000 --steps 24 --threads 1
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

ARMS = {
    "full": ("full", "identity"),
    "full+kakeya_e8": ("full", "kakeya_e8"),
    "full+kakeya_d4": ("full", "kakeya_d4"),
    "sink_window_4+64": ("sink_window", "identity"),
    "sink_window_4+64+kakeya_e8": ("sink_window", "kakeya_e8"),
}
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--histories", default="1000,2000")
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per arm and history")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--q-range", type=int, default=38)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_kv_compressor.json"))
    args = ap.parse_args()

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store.store import resolve_model

    torch.set_num_threads(args.threads)
    model = TorchCausalLM.load(resolve_model(args.model))
    spec, geometry = model.spec, model.geometry()
    arms = args.arms.split(",")
    meta = run_metadata(vars(args))
    out = {"arms": {a: {"strategy": ARMS[a][0], "compressor": ARMS[a][1], "histories": {}} for a in arms}}
    gen = torch.Generator().manual_seed(0)
    for n in (int(h) for h in args.histories.split(",")):
        history = torch.randint(0, spec.vocab_size, (n + args.steps + 1,), generator=gen)
        caches = {}
        for a in arms:
            strategy = KVStrategy(ARMS[a][0], 4, 64, compressor=ARMS[a][1], q_range=args.q_range)
            cache = make_cache(strategy, geometry, max_step=256, max_context=spec.max_context)
            for s in range(0, n, 256):  # prefill in 256-token chunks, as the server does
                ids = history[s : min(n, s + 256)]
                forward(model, ids, torch.arange(s, s + ids.numel()), cache, logits="none")
                cache.commit(ids.numel())
            caches[a] = cache
        times = {a: [] for a in arms}
        for step in range(args.steps):  # arms take turns, step by step
            p = n + step
            for a in arms:
                t0 = time.perf_counter()
                forward(model, history[p : p + 1], torch.tensor([p]), caches[a], logits="last")
                caches[a].commit(1)
                times[a].append(time.perf_counter() - t0)
        p = n + args.steps
        for a in arms:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                forward(model, history[p : p + 1], torch.tensor([p]), caches[a], logits="last")
                caches[a].commit(1)
            events = [e for e in prof.events() if e.name.startswith("aten::")]
            syncs = {name: sum(e.name == name for e in events) for name in SYNC_OPS}
            out["arms"][a]["histories"][str(n)] = {
                "decode_step_s_median": statistics.median(times[a]),
                "decode_step_s_all": [round(t, 5) for t in times[a]],
                "host_syncs_per_step": sum(syncs.values()),
                "host_syncs_by_op": syncs,
                "aten_op_events_per_step": len(events),
                "kv_live_bytes": caches[a].nbytes,
            }
        for a in arms:
            cell = out["arms"][a]["histories"][str(n)]
            base = next((b for b in arms if ARMS[b] == (ARMS[a][0], "identity")), None)
            if base is not None:
                cell["step_time_over_uncompressed"] = cell["decode_step_s_median"] / \
                    out["arms"][base]["histories"][str(n)]["decode_step_s_median"]
                cell["decode_tok_s_over_uncompressed"] = 1 / cell["step_time_over_uncompressed"]
            print(f"{n:>6} {a:<28} step {cell['decode_step_s_median'] * 1e3:7.1f} ms  "
                  f"x{cell.get('step_time_over_uncompressed', float('nan')):.2f}  syncs {cell['host_syncs_per_step']:4d}  "
                  f"ops {cell['aten_op_events_per_step']:5d}  kv {cell['kv_live_bytes'] / 1e6:.1f} MB", flush=True)
        del caches
    path = pathlib.Path(args.out)
    write_json(path, meta | out)
    plot(out, path.with_suffix(".png"))
    return 0


def plot(out: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(out["arms"])
    hist = list(out["arms"][arms[0]]["histories"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(arms)
    for i, a in enumerate(arms):
        cells = [out["arms"][a]["histories"][h] for h in hist]
        xs = [j + i * width for j in range(len(hist))]
        axes[0].bar(xs, [c["decode_step_s_median"] * 1e3 for c in cells], width, label=a)
        axes[1].bar(xs, [c["host_syncs_per_step"] for c in cells], width, label=a)
    for ax, title in zip(axes, ("decode step (ms, median)", "host syncs per decode step")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(hist))], [f"{h} tokens" for h in hist])
        ax.set_title(title)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
