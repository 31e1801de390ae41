"""Does a page shortlist choose the pages exact scoring chooses? (issue 29, item 2: hierarchical selection)

`paged` scores every evicted key's compact code at every step (`shortlist_pages` 0). With a shortlist of S,
each query first ranks the pages by a bound (per page, per layer and KV head, the elementwise max and min of
its compact keys: Quest, arXiv 2406.10774) and scores the keys of its S best pages only. This script runs the
exact `paged` arm on niah_ladder.py's passkey samples (in process, the same seeds: sample i here is sample i
there), and at every page choice of the last prefill chunk (the question) and of the answer's decode steps it
also makes the shortlisted choice for each S, from the same queries and the same stored keys. Per S and rung:

  same_set        fraction of (layer, KV head, query) whose chosen pages equal the exact choice
  pages_found     fraction of the exact choice's pages the shortlisted choice also holds
  best_page_found fraction of (layer, KV head, query) whose exact best page the shortlisted choice holds
  select_s        seconds per decode step spent choosing pages (exact and each S, same calls, side by side)
  bytes_read      bytes of selection data a decode step reads per layer and head (bounds + shortlisted keys)
  early_stop      (decode steps) whether scoring the shortlist in bound order could stop early and still choose
                  exactly what it chooses: per (layer, KV head, query), the shortlisted pages whose bound reaches the
                  recall_pages-th best exact page score (those must be scored; pages seen in part always are), as a
                  fraction of the pages scored now; and how often a page's exact score exceeded its bound (the
                  bound must hold for such a stop to be exact)

With --compare-query, every choice (exact and each S) is also made with the compact keys scored against the fp32
query (kv/paged_store.query_int8(False): the choice before the int8 query became the default), from the same queries
and keys, and compared with the int8 query's: `query_fp32_vs_int8` per rung, exact and per S (same_set, pages_found,
best_page_found of the int8 query's choice against the fp32 one's).

The end-to-end recall of a shortlisted arm is niah_ladder.py's (arm paged_4+508_p64_m8_s32).

    .venv/bin/python scripts/research/paged_shortlist.py --rungs 4000,7500 --samples 4 --shortlists 16,32,64
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402
from niah_ladder import make_sample, sample_rng  # noqa: E402

OUT = ROOT / "results" / "research" / "paged_shortlist.json"
ARM = dict(name="paged", sink=4, window=508, page_size=64, recall_pages=8, shortlist_pages=0)  # exact choice


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="fp32", help="fp32: the ladder's weights")
    ap.add_argument("--rungs", default="4000,7500")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--shortlists", default="16,32,64")
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-query", action="store_true", help="also choose with the fp32 query and compare")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from inference_engine.engine.generate import Engine
    from inference_engine.engine.requests import GenerateParams
    from inference_engine.kv import paged_store
    from inference_engine.kv.paged import PagedCache
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from inference_engine.server.app import ServeConfig, load_model

    torch.set_num_threads(args.threads)
    model = load_model(ServeConfig(model=args.model, weights=args.weights, threads=args.threads))
    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    engine = Engine(model, KVStrategy(**ARM), prefill_chunk=args.prefill_chunk)
    shortlists = [int(s) for s in args.shortlists.split(",")]
    exact_choose = PagedCache._choose_pages
    stats: dict = {}
    phase = {"rung": None, "on": False, "decode": False}

    def hooked(self, layer, q, k_all, plan, w):
        t0 = time.perf_counter()
        idx, ok = exact_choose(self, layer, q, k_all, plan, w)
        t1 = time.perf_counter()
        if not phase["on"] or plan["n_pages"] <= self.recall_pages:
            return idx, ok
        cell = stats.setdefault(phase["rung"], {"exact": {"select_s": 0.0}} | {s: {"select_s": 0.0} for s in shortlists})
        decode = phase["decode"]
        if decode:
            cell["exact"]["select_s"] += t1 - t0
        exact = torch.zeros(*idx.shape[:2], plan["n_pages"], dtype=torch.bool).scatter_(-1, idx, ok)
        qcell = cell.setdefault("query", {})
        if args.compare_query:  # the same choice with the fp32 query
            paged_store.query_int8(False)
            fidx, fok = exact_choose(self, layer, q, k_all, plan, w)
            paged_store.query_int8(True)
            _agree(qcell.setdefault("exact", {}), exact, torch.zeros_like(exact).scatter_(-1, fidx, fok), fidx, fok)
        self.shortlist = shortlists[0]
        self._update_bounds()  # the bounds a shortlisted cache keeps (built as pages complete), outside the timing
        for s in shortlists:
            self.shortlist = s
            t2 = time.perf_counter()
            if plan["n_pages"] > s:
                sidx, sok = self._choose_shortlisted(layer, q, k_all, plan, w)
            else:
                sidx, sok = exact_choose(self, layer, q, k_all, plan, w)
            t3 = time.perf_counter()
            if args.compare_query:
                paged_store.query_int8(False)
                fidx, fok = (self._choose_shortlisted(layer, q, k_all, plan, w) if plan["n_pages"] > s
                             else exact_choose(self, layer, q, k_all, plan, w))
                paged_store.query_int8(True)
                _agree(qcell.setdefault(s, {}), torch.zeros_like(exact).scatter_(-1, sidx, sok),
                       torch.zeros_like(exact).scatter_(-1, fidx, fok), fidx, fok)
            self.shortlist = 0
            got = torch.zeros_like(exact).scatter_(-1, sidx, sok)
            c = cell[s]
            if decode:
                c["select_s"] += t3 - t2
            c["same"] = c.get("same", 0) + int((got == exact).all(-1).sum())
            best = idx[..., :1]  # topk order: the exact choice's best page first
            c["best_found"] = c.get("best_found", 0) + int((got.gather(-1, best) | ~ok[..., :1]).sum())
            c["found"] = c.get("found", 0) + int((got & exact).sum())
            c["rows"] = c.get("rows", 0) + exact.shape[0] * exact.shape[1]
            c["exact_pages"] = c.get("exact_pages", 0) + int(exact.sum())
            c["n_pages"] = plan["n_pages"]
            if decode and plan["n_pages"] > s:
                self.shortlist = s
                _early_stop(c, self._shortlist_scores(layer, q, k_all, plan, w), self.recall_pages)
                self.shortlist = 0
        cell["exact"]["decode_steps"] = cell["exact"].get("decode_steps", 0) + (1 if decode and layer == 0 else 0)
        return idx, ok

    PagedCache._choose_pages = hooked
    meta = run_metadata(vars(args) | {"arm": ARM, "samples_from": "scripts/research/niah_ladder.py make_sample (passkey)"})
    g = model.geometry()
    for n in [int(r) for r in args.rungs.split(",")]:
        phase["rung"] = str(n)
        for i in range(args.samples):
            ids, key, depth = make_sample(tok, n, sample_rng("passkey", n, i))
            kv = engine.new_session_kv()
            cut = (len(ids) - 1) // args.prefill_chunk * args.prefill_chunk  # the question's chunk is measured
            engine.prefill(kv, ids[:cut])
            phase["on"] = True
            answer = []
            for e in engine.generate(kv, ids, GenerateParams(max_tokens=args.answer_tokens)):
                if hasattr(e, "token_id"):
                    phase["decode"] = True
                    answer.append(e.token_id)
            phase["on"] = phase["decode"] = False
            print(f"rung {n} sample {i}: key {key} answer {tok.decode(answer)!r}", flush=True)
    out: dict = {}
    for rung, cell in stats.items():
        steps = max(cell["exact"].get("decode_steps", 0), 1)
        row = {"pages": cell[shortlists[0]]["n_pages"], "decode_steps": steps,
               "exact_select_s_per_step": cell["exact"]["select_s"] / steps, "shortlists": {}}
        key_bytes = g.head_dim // 2 + 2  # int4 codes + fp16 scale per key
        for s in shortlists:
            c = cell[s]
            pages = c["n_pages"]
            row["shortlists"][str(s)] = {
                "same_set": c["same"] / c["rows"], "pages_found": c["found"] / max(c["exact_pages"], 1),
                "best_page_found": c["best_found"] / c["rows"],
                "select_s_per_step": c["select_s"] / steps,
                # at most S pages: no shortlist, every compact key read (the exact path)
                "bytes_read_per_layer_head": (pages * g.head_dim * 2 * 2 + s * 64 * key_bytes if pages > s
                                              else pages * 64 * key_bytes),
                "exact_bytes_read_per_layer_head": pages * 64 * key_bytes,
            }
            if c.get("es_rows"):
                row["shortlists"][str(s)]["early_stop"] = {
                    "pages_scored_now": c["es_scored"] / c["es_rows"],
                    "pages_that_must_be_scored": c["es_needed"] / c["es_rows"],
                    "fraction_that_must_be_scored": c["es_needed"] / max(c["es_scored"], 1),
                    "exact_above_bound": c["es_violations"], "queries": c["es_rows"]}
        if cell["query"]:
            row["query_fp32_vs_int8"] = {str(k): {"same_set": c["same"] / c["rows"],
                                                  "pages_found": c["found"] / max(c["ref_pages"], 1),
                                                  "best_page_found": c["best_found"] / c["rows"], "choices": c["rows"]}
                                         for k, c in cell["query"].items()}
        out[rung] = row
    write_json(pathlib.Path(args.out), meta | {"rungs": out})
    print(out)
    return 0


def _agree(c: dict, got, ref, ridx, rok) -> None:
    """Adds to cell c how the choice `got` (int8 query) agrees with `ref` (fp32 query): (Hkv, T, pages) bool each;
    ridx / rok: ref's pages in topk order (its best first)."""
    c["same"] = c.get("same", 0) + int((got == ref).all(-1).sum())
    c["found"] = c.get("found", 0) + int((got & ref).sum())
    c["best_found"] = c.get("best_found", 0) + int((got.gather(-1, ridx[..., :1]) | ~rok[..., :1]).sum())
    c["rows"] = c.get("rows", 0) + ref.shape[0] * ref.shape[1]
    c["ref_pages"] = c.get("ref_pages", 0) + int(ref.sum())


def _early_stop(c: dict, sc: dict, m: int) -> None:
    """Adds to cell c what an early-stopping scorer would have to score of this choice (see the module doc)."""
    import torch

    bound, short, pages_u, page_scores, whole = sc["bound"], sc["short"], sc["pages_u"], sc["page_scores"], sc["whole"]
    hkv, t, _ = bound.shape
    # pages_u pads short heads with page 0 (its scores -inf there): amax, so a pad never hides page 0's real score
    exact = torch.full_like(bound, float("-inf")).scatter_reduce(-1, pages_u[:, None].expand(hkv, t, -1), page_scores,
                                                                 reduce="amax")
    k = min(m, page_scores.shape[-1])
    thr = page_scores.topk(k, -1).values[..., -1:] if k else torch.full((hkv, t, 1), float("-inf"))
    whole_short = short & whole[None]
    needed = (whole_short & (bound >= thr)) | (short & ~whole[None])
    finite = exact > float("-inf")
    c["es_scored"] = c.get("es_scored", 0) + int(short.sum())
    c["es_needed"] = c.get("es_needed", 0) + int(needed.sum())
    c["es_violations"] = c.get("es_violations", 0) + int((whole_short & finite & (exact > bound)).sum())
    c["es_rows"] = c.get("es_rows", 0) + hkv * t


if __name__ == "__main__":
    raise SystemExit(main())
