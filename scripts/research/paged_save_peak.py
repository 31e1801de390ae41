"""Peak memory of saving a long `paged` session (issue 29, item 2: host RAM <= hot + `--page-ram-mb`).

A save writes the rows a `paged` session archived since its last save (its first save after a long append: all of
them; a compaction, every 64 appends: all of them again). Two arms, each (length, arm) in its own process so its
memory is its own:

  streamed  the product path since ebd566d: the cache hands the archive rows as RowSpans and the segment is written
            a piece (one layer, K/V and KV head's rows) at a time (`session_files.safetensors_pieces`)
  whole     how a save wrote them before (ebd566d / eac2f4c): the rows copied whole out of both tiers (`delta_state`
            with lazy=False), then safetensors serializing each whole segment into one bytes object, then written

Each process loads the real model, builds the daemon's engine (`build_engine`, the daemon's `paged` defaults and
`--page-ram-mb`), makes one session through it, fills its cache with random K/V through the cache's own API to
`length` positions (as `paged_memory.py`; the history is that many random token ids), and saves it with the
daemon's `SessionFiles` into a fresh state directory (the first save: every archived row), then appends `--turn`
more positions and saves again (a turn's save). Around each save: RssAnon before, its peak sampled every 2 ms
(psutil: rss - shared), and VmHWM (reset through /proc/self/clear_refs just before; it counts the spill files'
mapped pages too). The saved session is then loaded back (`SessionFiles.load` in a fresh instance) and its archive
compared with the live one's (a layer's rows, every table); that load's anonymous peak is measured too (its two
append segments: read into the tables one after another since 7abe68b's successor, concatenated first before, which
the whole arm restores, with the resident rows' per-layer copies stacked as before).

    .venv/bin/python scripts/research/paged_save_peak.py --lengths 8192,32768 --threads 2
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, PeakRSS, fill_with_random_kv, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "paged_save_peak.json"
ARMS = ("streamed", "whole")
MB = 1 << 20


def status() -> dict:
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


def timed_save(files, session) -> dict:
    """One save, with the memory it took: anonymous peak (sampled) and VmHWM over the save, less what was held before."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status()
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    t0 = time.perf_counter()
    with PeakRSS(0.002) as mem:
        files.save(session)
    seconds = time.perf_counter() - t0
    after = status()
    written = sum(g["bytes"] for g in session.saved["segments"])
    return {"seconds": seconds, "rss_anon_before": before["RssAnon"], "peak_anon_over_before": mem.peak_anon - before["RssAnon"],
            "vmhwm_over_before": after["VmHWM"] - before["VmRSS"], "segments_bytes": written,
            "largest_segment_bytes": max(g["bytes"] for g in session.saved["segments"])}


def run_one(args) -> dict:
    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.kv import stores
    from inference_engine.kv.byte_counts import kv_bytes
    from inference_engine.kv.slot_cache import SlotKVCache
    from inference_engine.model_store import resolve_model
    from inference_engine.persistence.session_files import SessionFiles
    from inference_engine.persistence.state_dir import StateDir
    from inference_engine.server.app import build_engine
    from inference_engine.server.config import ServeConfig
    from inference_engine.session.store import Session

    if args.arm == "whole":  # the save before ebd566d: the archive rows copied out whole, then serialized whole
        from safetensors.torch import save as st_save

        from inference_engine.persistence import session_files

        state = SlotKVCache._state
        SlotKVCache._state = lambda self, with_store, appended_from, lazy=False: state(self, with_store, appended_from, False)
        session_files.safetensors_pieces = lambda tensors: [st_save({k: v.contiguous() for k, v in tensors.items()})]
        session_files._joined = lambda parts, axis: torch.cat(parts, axis)  # a load: the segments concatenated first
        stores._stacked_rows = lambda slabs, axis, idx: torch.stack([x.index_select(axis, idx) for x in slabs]).cpu()
    torch.set_num_threads(args.threads)
    model = TorchCausalLM.load(resolve_model(args.model), weights=args.weights)
    cfg = ServeConfig(model=args.model, kv_strategy="paged", threads=args.threads, page_ram_mb=args.page_ram_mb)
    engine = build_engine(cfg, model)
    gen = torch.Generator().manual_seed(0)
    kv = engine.new_session_kv()
    fill_with_random_kv(kv.cache, args.length, args.chunk, gen)
    vocab = engine.model_info.vocab_size
    history = torch.randint(3, vocab, (args.length,), generator=gen).tolist()
    tiers = kv_bytes(kv.cache)
    with tempfile.TemporaryDirectory(dir=args.state_dir) as root:
        files = SessionFiles(StateDir(root), engine)
        sid = "save-peak-" + args.arm
        session = Session(sid, kv, frozenset(), history=history, lease=files.claim(sid))
        first = timed_save(files, session)
        fill_with_random_kv(kv.cache, args.length + args.turn, args.chunk, gen)
        session.history += torch.randint(3, vocab, (args.turn,), generator=gen).tolist()
        turn = timed_save(files, session)
        files.release(session)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = status()
        t0 = time.perf_counter()
        with PeakRSS(0.002) as mem:  # its two append segments: joined (whole) or read in turn (streamed)
            loaded = SessionFiles(StateDir(root), engine).load(sid)
        load = {"seconds": time.perf_counter() - t0, "peak_anon_over_before": mem.peak_anon - before["RssAnon"],
                "rss_anon_after_over_before": status()["RssAnon"] - before["RssAnon"]}
        live, back = kv.cache, loaded.kv.cache

        def rows_equal(table: str, layer: int) -> bool:
            a, b = getattr(live, table), getattr(back, table)
            return a.rows == b.rows and all(torch.equal(a.span(0, a.rows, (layer,))[n], b.span(0, a.rows, (layer,))[n]) for n in a.layout)

        same = back.next_position == live.next_position and all(
            rows_equal(t, layer) for t in ("pages", "keys", "far_keys") if getattr(live, t).rows
            for layer in (0, live.geometry.num_layers - 1))
        files.close()
    return {"length": args.length, "arm": args.arm, "turn": args.turn, "archived_rows": live.pages.rows,
            "tiers": {"hot": tiers.resident + tiers.selection, "warm_ram": tiers.stored, "cold_disk": tiers.cold},
            "first_save": first, "turn_save": turn, "load": load, "loaded_back_equal": bool(same)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--turn", type=int, default=2048, help="positions appended between the first save and the second")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--page-ram-mb", type=float, default=128)
    ap.add_argument("--chunk", type=int, default=256, help="positions a fill step (at most the engine's prefill chunk)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--state-dir", default=None, help="where the temporary state directories go (default: the system's)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--arm", default="", help=argparse.SUPPRESS)  # internal: one (length, arm), JSON on stdout
    ap.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arm:
        print(json.dumps(run_one(args)))
        return 0
    meta = run_metadata(vars(args))
    runs = []
    for length in (int(x) for x in args.lengths.split(",")):
        for arm in args.arms.split(","):
            if arm not in ARMS:
                raise SystemExit(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
            cmd = [sys.executable, __file__, "--arm", arm, "--length", str(length)] + [
                x for k in ("model", "weights", "turn", "page_ram_mb", "chunk", "threads", "state_dir")
                if getattr(args, k) is not None for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, check=True, capture_output=True, text=True)
            run = json.loads(out.stdout.strip().splitlines()[-1]) | {"process_s": time.perf_counter() - t0}
            runs.append(run)
            print(arm, length, {k: {m: round(v / MB, 1) if "bytes" in m or "over" in m or "anon" in m else round(v, 3)
                                    for m, v in run[k].items()} for k in ("first_save", "turn_save", "load")},
                  "loaded back equal:", run["loaded_back_equal"], file=sys.stderr, flush=True)
    by = {(r["length"], r["arm"]): r for r in runs}
    ratios = {}
    for length in sorted({r["length"] for r in runs}):
        s, w = by.get((length, "streamed")), by.get((length, "whole"))
        if s and w:
            ratios[str(length)] = {
                f"{k}_peak_anon_whole_over_streamed": w[k]["peak_anon_over_before"] / max(s[k]["peak_anon_over_before"], 1)
                for k in ("first_save", "turn_save", "load")} | {
                f"{k}_seconds_streamed_over_whole": s[k]["seconds"] / w[k]["seconds"] for k in ("first_save", "turn_save", "load")}
    write_json(pathlib.Path(args.out), meta | {
        "what": "peak anonymous memory of a paged session's save over what the process held before it (MB = 2^20 bytes "
                "in the printout; bytes here), streamed vs the whole-copy save, each in its own process",
        "runs": runs, "ratios": ratios, "load_average_at_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
