"""Where a decode step's time goes under dlm_restore (same-model and cross-model proposers) vs full / sink_window.

For each history length, each arm prefills a real-text history (chunks of --prefill-chunk)
and then runs --steps greedy decode steps of one token through TorchCausalLM.forward. Per
step it records the CPU time of the forward's thread (torch runs single-threaded here, so
this is the step's compute, robust to other processes on a shared box; `wall_s` is kept
too), split into:
  proposer_s        RestoreSource work, split into
                      proposer_open_s    opening the step: same-model = embedding the prefix; cross-model = the
                                         drafter's block encode of the prefix + f_θ's trunk (ftheta_trunk_s alone)
                      proposer_layers_s  the per-layer calls: same-model = the verifier's layer re-run causally over
                                         the evicted prefix (its attention also alone: proposer_attention_s);
                                         cross-model = f_θ's per-layer heads
  attention_s       the verifier's own attention (SDPA over resident ⊕ restored keys)
  decompress_s      reading K/V back out of a compressed resident store (KakeyaLattice arms)
  other_s           the rest: projections, MLPs, compression of the new rows, masks
plus resident KV bytes (between steps, and the peak incl. a prefill chunk's transient
room), the restored K/V bytes of one layer (the transient the design keeps
alive at a time) and the process RSS peak during the steps. Writes
results/research/restore_profile.json.

    .venv/bin/python scripts/research/profile_restore.py            # SmolLM2, 1k and 2k
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, PeakRSS, run_metadata, write_json  # noqa: E402

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "A quiet river runs past the old mill, and the miller counts the sacks of flour twice. ")
ARMS = {
    "full": dict(name="full"),
    "full+kakeya_e8": dict(name="full", compressor="kakeya_e8"),
    "sink_window_4+64": dict(name="sink_window", sink=4, window=64),
    "dlm_restore_4+64": dict(name="dlm_restore", sink=4, window=64),
    "dlm_restore_4+64+kakeya_e8": dict(name="dlm_restore", sink=4, window=64, compressor="kakeya_e8"),
    "dlm_restore_cross_4+64": dict(name="dlm_restore", sink=4, window=64, restore_from="drafter"),
    "dlm_restore_cross_4+64+kakeya_e8": dict(name="dlm_restore", sink=4, window=64, restore_from="drafter", compressor="kakeya_e8"),
    # refresh option: restored K/V reused for up to 8 steps (held bytes count in resident_kv_bytes); use --steps >= 8
    "dlm_restore_4+64_r8": dict(name="dlm_restore", sink=4, window=64, restore_refresh=8),
    "dlm_restore_cross_4+64_r8": dict(name="dlm_restore", sink=4, window=64, restore_from="drafter", restore_refresh=8),
    # pinned positions: the eviction-time scoring runs the proposer on the departing position (counted in proposer_s)
    "dlm_restore_cross_4+64+pin16": dict(name="dlm_restore", sink=4, window=64, restore_from="drafter", restore_pin=16),
}


class StepClock:
    """Accumulates time per component; installed around the source, SDPA and the store."""

    def __init__(self):
        self.t = {"proposer_s": 0.0, "proposer_open_s": 0.0, "proposer_layers_s": 0.0, "ftheta_trunk_s": 0.0,
                  "proposer_attention_s": 0.0, "attention_s": 0.0, "decompress_s": 0.0}
        self.in_proposer = False

    def reset(self):
        for k in self.t:
            self.t[k] = 0.0

    def timed(self, key, fn, *a, **kw):
        t0 = time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            self.t[key] += time.thread_time() - t0


class TimedSource:
    name = "timed-verifier"

    def __init__(self, inner, clock: StepClock):
        self.inner, self.clock = inner, clock
        self.layer_bytes = 0

    def open_step(self, history, evicted):
        clock, outer = self.clock, self

        def enter(part, fn, *a):
            clock.in_proposer = True
            t0 = time.thread_time()
            try:
                return clock.timed("proposer_s", fn, *a)
            finally:
                clock.in_proposer = False
                clock.t[part] += time.thread_time() - t0

        step = enter("proposer_open_s", self.inner.open_step, history, evicted)

        class Step:
            def kv_for_layer(self, layer):
                k, v = enter("proposer_layers_s", step.kv_for_layer, layer)
                outer.layer_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
                return k, v

            def close(self):
                enter("proposer_layers_s", step.close)

        return Step()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--histories", default="1000,2000")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="> 1 makes the CPU-time split meaningless; use wall_s then")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafter", default="smollm2-135m-dlm", help="cross-model arms: drafter + its shipped f_θ")
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "restore_profile.json"))
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.registry import make_strategy
    from inference_engine.model_store import resolve_model
    from kv_cache_proposer.same_model import VerifierRestoreSource

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model = TorchCausalLM.load(path, device=args.device)
    tok = AutoTokenizer.from_pretrained(path)
    filler = tok(FILLER, add_special_tokens=False)["input_ids"]
    clock = StepClock()
    sdpa = F.scaled_dot_product_attention

    def timed_sdpa(*a, **kw):
        return clock.timed("proposer_attention_s" if clock.in_proposer else "attention_s", sdpa, *a, **kw)

    F.scaled_dot_product_attention = timed_sdpa
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    source = TimedSource(VerifierRestoreSource(model), clock)
    cross = None
    if any(ARMS[a].get("restore_from") == "drafter" for a in args.arms.split(",")):
        from kv_cache_proposer import load_drafter
        from kv_cache_proposer.restore import DrafterRestoreSource, load_projection

        drafter = load_drafter(args.drafter, verifier_embed=model.embed, verifier_lm_head=model.lm_head, device=args.device)
        proj = load_projection(args.drafter, device=args.device)
        trunk = proj.trunk
        proj.trunk = lambda f: clock.timed("ftheta_trunk_s", trunk, f)
        cross = TimedSource(DrafterRestoreSource(drafter, proj, args.drafter), clock)
    results = {}
    for n_hist in [int(h) for h in args.histories.split(",")]:
        history = (filler * (n_hist // len(filler) + 1))[:n_hist]
        for arm in args.arms.split(","):
            st = make_strategy(**ARMS[arm])
            arm_source = None if st.name != "dlm_restore" else cross if st.restore_from == "drafter" else source
            cache = make_cache(st, model.geometry(), max_step=args.prefill_chunk, max_context=model.spec.max_context,
                               resources=arm_source)
            store_fetch = cache.store.fetch
            cache.store.fetch = lambda *a: clock.timed("decompress_s", store_fetch, *a)
            t0 = time.perf_counter()
            for i in range(0, n_hist, args.prefill_chunk):
                part = torch.tensor(history[i : i + args.prefill_chunk], device=model.device)
                logits, _ = forward(model, part, torch.arange(i, i + part.numel(), device=model.device), cache, logits="last")
                cache.commit()
            sync()
            prefill_s = time.perf_counter() - t0
            token = int(logits[-1].argmax())
            steps = []
            with PeakRSS(0.005) as mem:
                for s in range(args.steps + 1):  # the first step warms up and is not reported
                    clock.reset()
                    sync()
                    t0, c0 = time.perf_counter(), time.thread_time()
                    p = cache.next_position
                    logits, _ = forward(model, torch.tensor([token], device=model.device), torch.tensor([p], device=model.device),
                                              cache, logits="last")
                    cache.commit()
                    sync()
                    wall, total = time.perf_counter() - t0, time.thread_time() - c0
                    token = int(logits[-1].argmax())
                    if s:
                        row = {"wall_s": wall, "total_s": total, **dict(clock.t)}
                        row["other_s"] = total - row["proposer_s"] - row["attention_s"] - row["decompress_s"]
                        steps.append(row)
            mean = {k: sum(r[k] for r in steps) / len(steps) for k in steps[0]}
            evicted = getattr(cache, "evicted_total", 0)
            cell = {
                "history_tokens": n_hist,
                "prefill_s": prefill_s,
                "decode_step_mean": mean,
                "decode_steps": steps,
                "decode_tokens_per_s": 1.0 / mean["total_s"],  # per CPU second of the step
                "decode_tokens_per_wall_s": 1.0 / mean["wall_s"],
                "resident_kv_bytes": cache.nbytes,  # refresh option: incl. the held restored K/V
                "held_restored_kv_bytes": getattr(cache, "held_nbytes", 0),
                "resident_kv_peak_bytes": cache.peak_nbytes,  # incl. a prefill chunk's transient room
                "resident_positions": cache.resident_positions,
                "restored_positions_per_step": evicted,
                "restored_kv_bytes_one_layer": arm_source.layer_bytes if evicted else 0,
                "restored_kv_bytes_all_layers_if_held": arm_source.layer_bytes * model.spec.num_layers if evicted else 0,
                "rss_peak_during_decode_bytes": mem.peak,
            }
            arm_source.layer_bytes = 0
            results.setdefault(str(n_hist), {})[arm] = cell
            m = mean
            print(f"H={n_hist} {arm:28s} step {m['total_s'] * 1e3:8.1f} ms = proposer {m['proposer_s'] * 1e3:8.1f}"
                  f" (open {m['proposer_open_s'] * 1e3:7.1f}, layers {m['proposer_layers_s'] * 1e3:7.1f}, f_θ trunk "
                  f"{m['ftheta_trunk_s'] * 1e3:6.1f}, its attention {m['proposer_attention_s'] * 1e3:6.1f})"
                  f" + attention {m['attention_s'] * 1e3:6.1f}"
                  f" + decompress {m['decompress_s'] * 1e3:6.1f} + other {m['other_s'] * 1e3:6.1f};"
                  f" resident {cache.nbytes / 1e6:.2f} MB; prefill {prefill_s:.1f}s", flush=True)
    for arms in results.values():
        if "full" in arms:
            for cell in arms.values():
                cell["tokens_per_s_ratio_to_full"] = cell["decode_tokens_per_s"] / arms["full"]["decode_tokens_per_s"]
    config = dict(model=args.model, histories=args.histories, arms={a: ARMS[a] for a in args.arms.split(",")},
                  steps=args.steps, prefill_chunk=args.prefill_chunk, device=args.device, dtype="float32")
    write_json(__import__("pathlib").Path(args.out), {**run_metadata(config), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
