"""What archiving costs a decoding `paged` session per token, by how the page store grows (issue 29).

A RowTable's rows axis is not its outermost, so growing it copies the table. Until 62c1da3 it grew a page at
a time: every 64 decoded tokens the whole page store was copied. Now it grows by at least a quarter. Side by
side in one process, a table of SmolLM2's page-store shape (30 layers, K and V, 3 KV heads, head_dim 64,
fp32) holding --lengths rows takes --tokens one-row appends (what a decode step archives), with each growth
policy; the JSON has seconds per appended token (mean: the growth copies are rare and large, so a median
would hide them; over --tokens = a quarter of the length, each policy pays its growths as a long session
would), the worst single append, and how many appends took over 10x the fastest.

    .venv/bin/python scripts/research/row_table_growth.py --lengths 8192,32768 --tokens 8192
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "row_table_growth.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    import torch

    from inference_engine.kv.paged_store import IdentityRows, RowTable

    class PageAtATime(RowTable):
        """The growth before 62c1da3: capacity rounded up to the next page, nothing more."""

        def reserve(self, rows: int) -> None:
            if rows <= self.capacity:
                return
            cap = -(-rows // self.page) * self.page
            self._set({name: torch.cat([x, x.new_zeros(*x.shape[:3], cap - x.shape[3], *x.shape[4:])], 3)
                       for name, x in self.data.items()})
            self.capacity = cap

    torch.set_num_threads(args.threads)
    dims = dict(num_layers=30, num_kv_heads=3, head_dim=64, stack=2, page=64, device="cpu")
    row = torch.randn(30, 2, 3, 1, 64)
    out: dict = {}
    for n in [int(x) for x in args.lengths.split(",")]:
        cell = {}
        for name, cls in (("page_at_a_time", PageAtATime), ("by_a_quarter", RowTable)):
            t = cls(IdentityRows(64, torch.float32), **dims)
            t.reserve(n)
            t.rows = n  # full (n is whole pages): the next append grows it, under either policy
            times = []
            for _ in range(args.tokens):
                t0 = time.perf_counter()
                t.reserve(t.rows + 1)
                t.write_all(t.rows, row)
                t.rows += 1
                times.append(time.perf_counter() - t0)
            cell[name] = {"s_per_token_mean": sum(times) / len(times), "worst_append_s": max(times),
                          "slow_appends": sum(x > 10 * min(times) for x in times), "capacity_after": t.capacity,
                          "table_mb_after": round(t.nbytes / 2 ** 20, 1)}
            del t
        cell["mean_ratio_page_over_quarter"] = cell["page_at_a_time"]["s_per_token_mean"] / cell["by_a_quarter"]["s_per_token_mean"]
        out[str(n)] = cell
        print(n, cell, flush=True)
    write_json(pathlib.Path(args.out), run_metadata(vars(args)) | {"lengths": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
