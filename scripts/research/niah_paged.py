"""Passkey recall of `paged` against `full` and `sink_window`, with byte counts, decode speed and
the paged step's cost split (issue 15).

Samples are niah_ladder.py's (same generator, seeds and templates: sample i of a rung here is
sample i there). The engine runs in-process (no gRPC): per sample, prefill the document in
--prefill-chunk chunks, then greedy-decode --answer-tokens; a hit = the passkey appears in the
answer. Arms run side by side on the same samples, one process, so decode tok/s ratios to `full`
are taken on the same machine under the same load (timings on a shared 2-core box are noisy).

Per cell: hits, resident bytes (the hot slab), selection bytes (paged: compact keys), stored bytes
(paged: page store), decode tok/s (median over samples), prefill seconds, and for paged the
per-decode-step split (scoring, page fetch/decode, attention over the chosen keys; wall seconds),
and per row the same split summed over the prefill (`prefill_split_s`).

    .venv/bin/python scripts/research/niah_paged.py --samples 4 --rungs 1000,2000,4000,7500
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, command_line, run_metadata, write_json  # noqa: E402
from niah_ladder import EVAL_SEED, make_sample, sample_rng  # noqa: E402

OUT = ROOT / "results" / "research" / "paged_recall.json"

# name -> KVStrategy keyword arguments
ARMS = {
    "full": dict(name="full"),
    "sink_window_4+1020": dict(name="sink_window", sink=4, window=1020),
    "sink_window_4+508": dict(name="sink_window", sink=4, window=508),
    "paged_4+508_p64_m8": dict(name="paged", sink=4, window=508, page_size=64, recall_pages=8),
    "paged_4+252_p64_m8": dict(name="paged", sink=4, window=252, page_size=64, recall_pages=8),
    "paged_4+508_p64_m8_int8keys": dict(name="paged", sink=4, window=508, page_size=64, recall_pages=8, page_key_bits=8),
    "paged_4+508_p64_m8_e8pages": dict(name="paged", sink=4, window=508, page_size=64, recall_pages=8,
                                       page_compressor="kakeya_e8"),
}
# The budget paged must stay within (issue 15): sink_window 4+1020's resident bytes.
CAP_BYTES = 47_923_200  # sink_window 4+1020 in fp32: (4 + 1020 + 16) slots x 30 layers x 3 heads x 64 x 4 B x 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="fp32", help="fp32 matches the ladder's full / sink_window cells")
    ap.add_argument("--arms", default="full,sink_window_4+1020,paged_4+508_p64_m8")
    ap.add_argument("--rungs", default="1000,2000,4000,7500")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--rung-samples", default="", help="per-rung sample counts overriding --samples: RUNG=N,...")
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--speed-steps", type=int, default=0,
                    help="speed mode: per rung, prefill sample 0 into every arm, then time this many decode steps per arm, "
                         "the arms' steps interleaved one by one (load drift hits every arm alike); writes --out")
    ap.add_argument("--merge-speed", default="", help="copy speed-mode JSONs (comma-separated) into --out: the first as its "
                                                      "decode_speed section, the others as decode_speed_<weights>")
    ap.add_argument("--merge", default="", help="join recall parts (comma-separated JSONs from runs of this script) into --out, "
                                                "each cell keeping its part's provenance, with the ladder's own cells for reference")
    args = ap.parse_args()
    if args.merge_speed:
        return merge_speed([pathlib.Path(x) for x in args.merge_speed.split(",")], pathlib.Path(args.out))
    if args.merge:
        return merge(args.merge.split(","), pathlib.Path(args.out))

    import torch
    from transformers import AutoTokenizer

    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.requests import GenerateParams
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from inference_engine.server.app import ServeConfig, load_model

    torch.set_num_threads(args.threads)
    model = load_model(ServeConfig(model=args.model, weights=args.weights, threads=args.threads))
    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    rungs = [int(r) for r in args.rungs.split(",")]
    per_rung = {int(a): int(b) for a, b in (x.split("=") for x in args.rung_samples.split(",") if x)}
    arms = args.arms.split(",")
    engines = {a: Engine(model, KVStrategy(**ARMS[a]), prefill_chunk=args.prefill_chunk) for a in arms}
    meta = run_metadata(vars(args) | {"eval_seed": EVAL_SEED, "arms_config": {a: ARMS[a] for a in arms},
                                      "samples_from": "scripts/research/niah_ladder.py make_sample "
                                                      "(same seeds: sample i = ladder sample i)",
                                      "cap_bytes": CAP_BYTES})
    results = {a: {"config": ARMS[a], "rungs": {}} for a in arms}
    out = pathlib.Path(args.out)
    if args.speed_steps:
        return speed(args, engines, tok, rungs, meta, out)
    for n in rungs:
        count = per_rung.get(n, args.samples)
        samples = [make_sample(tok, n, sample_rng("passkey", n, i)) for i in range(count)]
        rows = {a: [] for a in arms}
        for i, (ids, key, depth) in enumerate(samples):
            for a in arms:  # arms interleaved per sample: the same load for every arm's timings
                engine = engines[a]
                kv = engine.new_session_kv()
                t0 = time.perf_counter()
                engine.prefill(kv, ids)
                prefill_s = time.perf_counter() - t0
                cache = kv.cache
                timings = getattr(cache, "timings", None)
                prefill_split = None
                if timings is not None:  # what the prefill's recall cost (scoring / fetch / attention), then reset for decode
                    prefill_split = {k: round(timings[k], 3) for k in ("score_s", "fetch_s", "attend_s")}
                    for k in timings:
                        timings[k] = 0
                toks, stamps = [], []
                for e in engine.generate(kv, ids, GenerateParams(max_tokens=args.answer_tokens)):
                    if isinstance(e, TokenGenerated):
                        toks.append(e.token_id)
                        stamps.append(time.perf_counter())
                steps = len(toks) - 1  # the first token comes from the prefill's logits
                dec = stamps[-1] - stamps[0] if steps > 0 else 0.0
                answer = tok.decode(toks, skip_special_tokens=True)
                row = {"sample": i, "key": key, "depth": round(depth, 3), "hit": key in answer, "answer": answer,
                       "prompt_tokens": len(ids), "prefill_s": round(prefill_s, 3),
                       "decode_tok_s": steps / dec if dec > 0 else 0.0,
                       "resident_bytes": getattr(cache, "resident_nbytes", cache.store.nbytes),
                       "selection_bytes": getattr(cache, "selection_nbytes", 0),
                       "stored_bytes": getattr(cache, "stored_nbytes", 0)}
                if prefill_split is not None:
                    row["prefill_split_s"] = prefill_split
                if timings is not None and steps > 0:
                    row["decode_step_split_s"] = {k: timings[k] / steps for k in ("score_s", "fetch_s", "attend_s")}
                    row["archived_positions"] = cache.pages.rows
                rows[a].append(row)
                print(f"{n} #{i} {a}: hit={row['hit']} {answer!r} prefill {prefill_s:.1f}s decode {row['decode_tok_s']:.1f} tok/s",
                      flush=True)
        for a in arms:
            results[a]["rungs"][str(n)] = cell(rows[a])
        summarize(results, arms)
        write_json(out, meta | {"complete": n == rungs[-1], "arms": results, "summary": summarize(results, arms)})
    plot(results, arms, out.with_suffix(".png"))
    return 0


def speed(args, engines: dict, tok, rungs: list, meta: dict, out: pathlib.Path) -> int:
    """Decode step time per arm at each rung, steps interleaved across arms; ratios to full."""
    import statistics

    from inference_engine.engine import steps

    res = {}
    for n in rungs:
        ids, _, _ = make_sample(tok, n, sample_rng("passkey", n, 0))
        kvs = {}
        for a, engine in engines.items():
            kvs[a] = engine.new_session_kv()
            engine.prefill(kvs[a], ids)
            for k in getattr(kvs[a].cache, "timings", {}):
                kvs[a].cache.timings[k] = 0
        feed = tok(" The grass is green. The sky is blue.", add_special_tokens=False)["input_ids"]
        times = {a: [] for a in engines}
        for i in range(args.speed_steps):
            for a, engine in engines.items():
                t0 = time.perf_counter()
                steps.decode_step(engine.model, kvs[a], feed[i % len(feed)])
                times[a].append(time.perf_counter() - t0)
        cell = {}
        for a in engines:
            c = kvs[a].cache
            cell[a] = {"prompt_tokens": len(ids), "step_s_median": statistics.median(times[a]), "step_s": [round(x, 4) for x in times[a]],
                       "resident_bytes": getattr(c, "resident_nbytes", c.store.nbytes),
                       "selection_bytes": getattr(c, "selection_nbytes", 0),
                       "stored_bytes": getattr(c, "stored_nbytes", 0)}
            if hasattr(c, "timings"):
                cell[a]["paged_split_s_per_step"] = {k: c.timings[k] / args.speed_steps for k in ("score_s", "fetch_s", "attend_s")}
                cell[a]["archived_positions"] = c.pages.rows
                cell[a]["pages"] = -(-c.pages.rows // c.page_size)
        if "full" in cell:
            for a in engines:  # per step pair (same moment, same load): full's time / this arm's time
                pairs = sorted(f / x for f, x in zip(times["full"], times[a]))
                cell[a]["tok_s_over_full_median_of_step_pairs"] = round(pairs[len(pairs) // 2], 3)
        res[str(n)] = cell
        print(n, {a: (round(v["step_s_median"] * 1000, 1), v.get("tok_s_over_full_median_of_step_pairs")) for a, v in cell.items()},
              flush=True)
        write_json(out, meta | {"mode": "speed", "complete": n == rungs[-1], "rungs": res})
    return 0


LADDER = ROOT / "results" / "research" / "niah_ladder.json"


def ladder_reference(rungs: dict) -> dict:
    """The ladder's full and sink_window 4+1020 hits on the same samples (sample i here = ladder row i;
    the ladder's CPU and H100 cells agree sample for sample, see its cross_device_agreement)."""
    import json

    lad = json.loads(LADDER.read_text())
    out = {}
    for arm in ("full", "sink_window_4+1020"):
        for n, count in rungs.items():
            c = lad["arms"][arm]["rungs"].get(n)
            if c and "rows" in c:
                hits = [r["hit"] for r in c["rows"][:count]]
                out.setdefault(arm, {})[n] = {"samples": len(hits), "hits": sum(hits), "per_sample": hits,
                                              "all_20": f"{sum(r['hit'] for r in c['rows'])}/{len(c['rows'])}",
                                              "device": c.get("device")}
    return {"source": str(LADDER.relative_to(ROOT)), "arms": out}


def merge(parts: list, out: pathlib.Path) -> int:
    import json

    docs = [(p, json.loads(pathlib.Path(p).read_text())) for p in parts]
    arms = {}
    for p, d in docs:
        prov = {k: d[k] for k in ("command", "commit", "dirty_worktree", "date_utc")} | {"part": p}
        for a, r in d["arms"].items():
            have = arms.setdefault(a, {"config": r["config"], "rungs": {}})
            for n, c in r["rungs"].items():
                if n not in have["rungs"] or c["samples"] >= have["rungs"][n]["samples"]:
                    have["rungs"][n] = c | {"provenance": prov}
    most = {}
    for r in arms.values():
        for n, c in r["rungs"].items():
            most[n] = max(most.get(n, 0), c["samples"])
    names = list(arms)
    meta = run_metadata({"parts": parts})
    meta["parts"] = [{"part": p, "command": d["command"], "commit": d["commit"], "date_utc": d["date_utc"], "machine": d["machine"]}
                     for p, d in docs]
    ref = ladder_reference(most)
    summary = summarize(arms, names)
    for a in names:  # rungs this run has no full cell for: full's hits on the same samples, from the ladder
        for n, c in arms[a]["rungs"].items():
            f = ref["arms"].get("full", {}).get(n)
            if "recall_minus_full_points" not in summary[a][n] and f and f["samples"] >= c["samples"]:
                full_hits = sum(f["per_sample"][: c["samples"]])
                summary[a][n]["ladder_full_hits_same_samples"] = f"{full_hits}/{c['samples']}"
                summary[a][n]["recall_minus_ladder_full_points"] = round(100 * (c["hits"] - full_hits) / c["samples"], 1)
    write_json(out, meta | {"complete": all(d.get("complete") for _, d in docs), "cap_bytes": CAP_BYTES, "arms": arms,
                            "summary": summary, "ladder_reference": ref})
    plot(arms, names, out.with_suffix(".png"), ref)
    return 0


def merge_speed(parts: list, out: pathlib.Path) -> int:
    """Copy speed-mode JSONs into `out`: the first as `decode_speed` (plotted), each further one as
    `decode_speed_<its weights>` (e.g. the same measurement with --weights int4)."""
    import json

    doc = json.loads(out.read_text())
    first = None
    for i, part in enumerate(parts):
        sp = json.loads(part.read_text())
        key = "decode_speed" if i == 0 else f"decode_speed_{sp.get('config', {}).get('weights') or 'part' + str(i)}"
        doc[key] = {"part": str(part.relative_to(ROOT)) if part.is_absolute() else str(part),
                    "provenance": {k: sp[k] for k in ("command", "commit", "dirty_worktree", "date_utc", "machine")},
                    "rungs": sp["rungs"]}
        first = first or sp
    doc["speed_merge_command"] = command_line()
    write_json(out, doc)
    plot(doc["arms"], list(doc["arms"]), out.with_suffix(".png"), doc.get("ladder_reference"), first["rungs"])
    return 0


def cell(rows: list) -> dict:
    def med(xs):
        return sorted(xs)[len(xs) // 2]

    c = {"samples": len(rows), "hits": sum(r["hit"] for r in rows), "recall": sum(r["hit"] for r in rows) / len(rows),
         "resident_bytes_max": max(r["resident_bytes"] for r in rows),
         "selection_bytes_max": max(r["selection_bytes"] for r in rows),
         "stored_bytes_max": max(r["stored_bytes"] for r in rows),
         "decode_tok_s_median": med([r["decode_tok_s"] for r in rows]),
         "prefill_s_median": med([r["prefill_s"] for r in rows])}
    c["hot_bytes_max"] = c["resident_bytes_max"] + c["selection_bytes_max"]
    if all("decode_step_split_s" in r for r in rows):
        c["decode_step_split_s_median"] = {k: med([r["decode_step_split_s"][k] for r in rows]) for k in rows[0]["decode_step_split_s"]}
    c["rows"] = rows
    return c


def summarize(results: dict, arms: list) -> dict:
    """Per arm and rung: hits vs full on the same samples, decode speed ratio to full, hot bytes vs the cap."""
    out = {}
    for a in arms:
        for n, c in results[a]["rungs"].items():
            f = results.get("full", {}).get("rungs", {}).get(n)
            s = {"hits": f"{c['hits']}/{c['samples']}", "hot_bytes": c["hot_bytes_max"],
                 "hot_bytes_within_cap": c["hot_bytes_max"] <= CAP_BYTES}
            if f is not None:
                s["recall_minus_full_points"] = round(100 * (c["recall"] - f["recall"]), 1)
                s["decode_tok_s_over_full"] = round(c["decode_tok_s_median"] / f["decode_tok_s_median"], 3)
                # per sample, same samples: the decode speed ratio's spread
                ratios = sorted(r["decode_tok_s"] / q["decode_tok_s"] for r, q in zip(c["rows"], f["rows"]) if q["decode_tok_s"])
                if ratios:
                    s["decode_ratio_per_sample_min_median_max"] = [round(ratios[0], 3), round(ratios[len(ratios) // 2], 3),
                                                                   round(ratios[-1], 3)]
            out.setdefault(a, {})[n] = s
    return out


def plot(results, arms, png, ladder=None, speed=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for a in arms:
        r = results[a]["rungs"]
        xs = sorted(int(n) for n in r)
        style = dict(marker="o", label=a, linestyle="--" if a.startswith("sink") else "-")
        axes[0].plot(xs, [r[str(n)]["recall"] for n in xs], **style)
        axes[1].plot(xs, [r[str(n)]["hot_bytes_max"] / 1e6 for n in xs], **style)
        if speed is None:
            axes[2].plot(xs, [r[str(n)]["decode_tok_s_median"] for n in xs], **style)
    for arm, r in (ladder or {}).get("arms", {}).items():  # same samples, from the ladder
        xs = sorted(int(n) for n in r)
        axes[0].plot(xs, [r[str(n)]["hits"] / r[str(n)]["samples"] for n in xs], marker="x", color="grey", linewidth=0.8,
                     linestyle=":" if arm.startswith("sink") else "-", label=f"ladder {arm} (same samples)")
    axes[0].legend(fontsize=7)
    axes[1].axhline(CAP_BYTES / 1e6, color="grey", linewidth=0.8, label="cap (sink_window 4+1020)")
    axes[0].set(title="passkey recall", xlabel="prompt tokens", ylabel="recall", ylim=(-0.05, 1.05))
    axes[1].set(title="hot bytes: resident + selection data", xlabel="prompt tokens", ylabel="MB")
    if speed is None:
        axes[2].set(title="decode tok/s (same run, same samples)", xlabel="prompt tokens", ylabel="tok/s")
    else:
        xs = sorted(int(n) for n in speed)
        for a in speed[str(xs[0])]:
            axes[2].plot(xs, [speed[str(n)][a]["tok_s_over_full_median_of_step_pairs"] for n in xs], marker="o", label=a,
                         linestyle="--" if a.startswith("sink") else "-")
        axes[2].set(title="decode speed / full (interleaved steps, median)", xlabel="prompt tokens", ylabel="x full")
        axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
