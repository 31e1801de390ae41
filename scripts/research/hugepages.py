"""The native step's int4 blocks in 2 MB pages against 4 KB pages, side by side (backends/torch/hugepages.py).

One model (--weights int4), two native row steps over it: one whose int4 blocks sit in an arena madvised
MADV_HUGEPAGE (the default), one in plain 4 KB pages (KAKEYA_HUGEPAGES=0 while it is built). Both hold the same
bytes. Measured, interleaved call by call so a drift of the box's speed lands on both alike:

- `kernel`: the int4 kernel (q4_matmul) over every layer's blocks in turn, with 1 and 5 rows of activations;
- `decode`: whole decode steps (forward + commit of one token, row-exact) of each --contexts entry, a cache per entry
  filled with random K/V (bench_common.fill_with_random_kv); `full@N` and `paged@N` (sink 4, window 508, pages of 64,
  8 recalled, the shortlist of 64 forced on, --kv-dtype fp16 as `auto` picks on this CPU). Each round one step per
  cell and arm. The first step of each cell is also run by both arms on the same state (the second after an abort)
  and their logits compared bit for bit.

Writes the medians, the ratios (4 KB time / 2 MB time: > 1 means huge pages are faster) and how many bytes the
kernel backed with huge pages (/proc/self/smaps).

    .venv/bin/python scripts/research/hugepages.py --threads 2 --contexts full@1024,paged@1024,paged@32768
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, fill_with_random_kv, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "hugepages_avx2.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="full@1024,paged@1024,paged@32768")
    ap.add_argument("--kernel-rounds", type=int, default=40)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    import torch

    from inference_engine.backends.torch import hugepages, native
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    model = TorchCausalLM.load(resolve_model(args.model), weights="int4")
    if not model.use_native_step():
        raise SystemExit("the native step is unavailable here (see the log)")
    module = native.load()
    steps = {"huge": model.native_step}
    saved = os.environ.get("KAKEYA_HUGEPAGES")
    os.environ["KAKEYA_HUGEPAGES"] = "0"
    try:
        steps["4k"] = native.NativeRowStep(model, module)
    finally:
        if saved is None:
            os.environ.pop("KAKEYA_HUGEPAGES")
        else:
            os.environ["KAKEYA_HUGEPAGES"] = saved
    if not hugepages.enabled() or not steps["huge"].arena.huge:
        raise SystemExit("this OS gives no transparent huge pages (THP never, or not Linux): nothing to compare")
    arenas = {arm: [a for a in (s.arena, s.head_arena) if a is not None] for arm, s in steps.items()}
    out: dict = {"arena_bytes": sum(a.nbytes for a in arenas["huge"]),
                 "huge_page_bytes": {arm: sum(a.huge_bytes() for a in v) for arm, v in arenas.items()}}
    print(out, flush=True)

    # kernel: every layer's blocks in turn (what a step streams), 1 and 5 rows
    blocks = {arm: [(v, v.shape[1] * 32) for v in s.arena.views] for arm, s in steps.items()}
    gen = torch.Generator().manual_seed(0)
    xs = {rows: {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in blocks["huge"]}} for rows in (1, 5)}
    planes = native.PLANES if isinstance(native.PLANES, int) else 2

    def kernel(arm: str, rows: int) -> float:
        t0 = time.perf_counter()
        for w, k in blocks[arm]:
            module.q4_matmul(xs[rows][k], w, 0, planes, None)
        return time.perf_counter() - t0

    times: dict = {f"{arm}/{rows}": [] for rows in (1, 5) for arm in steps}
    for r in range(args.kernel_rounds + 2):
        for key in times:
            arm, rows = key.split("/")
            t = kernel(arm, int(rows))
            if r >= 2:  # two warm rounds
                times[key].append(t)
    out["kernel_ms"] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    out["kernel_ratio_4k_over_huge"] = {rows: out["kernel_ms"][f"4k/{rows}"] / out["kernel_ms"][f"huge/{rows}"]
                                        for rows in ("1", "5")}
    print("kernel", out["kernel_ms"], out["kernel_ratio_4k_over_huge"], flush=True)

    # decode steps
    geometry = model.geometry()
    caches = {}
    for cell in args.contexts.split(","):
        kind, n = cell.split("@")
        if kind == "full":
            st = KVStrategy("full", kv_dtype="fp16")
        elif kind == "paged":
            st = KVStrategy("paged", 4, 508, page_size=64, recall_pages=8, shortlist_pages=64, shortlist_from=0,
                            kv_dtype="fp16")
        else:
            raise SystemExit(f"--contexts takes full@N and paged@N, got {cell!r}")
        caches[cell] = make_cache(st, geometry, max_step=512, max_context=model.spec.max_context)
        fill_with_random_kv(caches[cell], int(n), 512, torch.Generator().manual_seed(int(n)))
    token = model.tensor([17])

    def step(arm: str, cache, commit: bool = True):
        model.native_step = steps[arm]
        at = cache.next_position
        t0 = time.perf_counter()
        logits = forward(model, token, range(at, at + 1), cache, logits="last", row_exact=True)
        if commit:
            cache.commit()
        else:
            cache.abort()
        return time.perf_counter() - t0, logits

    same = {}
    for cell, cache in caches.items():
        _, a = step("4k", cache, commit=False)
        _, b = step("huge", cache)
        same[cell] = bool(torch.equal(a[0] if isinstance(a, tuple) else a, b[0] if isinstance(b, tuple) else b))
    out["logits_identical"] = same
    dec: dict = {f"{cell}/{arm}": [] for cell in caches for arm in steps}
    for _ in range(args.decode_steps):
        for key in dec:
            cell, arm = key.split("/")
            dec[key].append(step(arm, caches[cell])[0])
    model.native_step = steps["huge"]
    out["decode_ms"] = {k: 1e3 * statistics.median(v) for k, v in dec.items()}
    out["decode_ratio_4k_over_huge"] = {cell: out["decode_ms"][f"{cell}/4k"] / out["decode_ms"][f"{cell}/huge"]
                                        for cell in caches}
    print("decode", out["decode_ms"], out["decode_ratio_4k_over_huge"], same, flush=True)
    meta = run_metadata(vars(args) | {"weights": "int4", "planes": planes,
                                      "what": "ms medians; ratios = 4 KB pages' time / 2 MB pages' time"})
    write_json(pathlib.Path(args.out), meta | out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
