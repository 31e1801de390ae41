"""FlexAttention against the SDPA paths the torch backend uses, for one decode row (issue 28 item 4).

The question: could sink + window + recalled pages become one FlexAttention kernel with a block mask
built from the step's layout? Measured here for SmolLM2's attention shape (9 query heads over 3 KV
heads, head_dim 64), one query row over N keys with a per-key validity mask (the sink_window ring,
`full`), interleaved in rounds:
  sdpa         F.scaled_dot_product_attention with the bool mask, as backends/torch/attention.py
  flex         torch.compile(flex_attention) with a BlockMask made once (its kernel alone)
  flex+mask    the same, the BlockMask made in the call (a step's mask changes every step)
and the largest difference to SDPA's output. Writes results/research/flex_attention.json.

    python scripts/research/flex_attention.py --threads 2 --device cpu
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keys", default="1040,4096", help="key counts (1040 = sink 4 + window 1020 + 16 spare slots)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=50, help="calls per arm per round")
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "flex_attention.json"))
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    dev = torch.device(args.device)
    h, hkv, d, scale = 9, 3, 64, 0.125
    flex = torch.compile(flex_attention)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    for n in (int(x) for x in args.keys.split(",")):
        g = torch.Generator().manual_seed(n)
        q = torch.randn(1, h, 1, d, generator=g).to(dev)
        k = torch.randn(1, hkv, n, d, generator=g).to(dev)
        v = torch.randn(1, hkv, n, d, generator=g).to(dev)
        valid = torch.ones(n, dtype=torch.bool, device=dev)
        valid[n // 2: n // 2 + 16] = False  # the ring's free slots

        def mask_mod(b, hh, qi, ki):
            return valid[ki]

        t0 = time.perf_counter()
        block = create_block_mask(mask_mod, None, None, 1, n, device=dev)
        first_mask_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            o_flex = flex(q, k, v, block_mask=block, enable_gqa=True, scale=scale)
        except Exception as e:  # noqa: BLE001 - an inductor failure is a finding: recorded, the next size runs
            msg = str(e).strip().splitlines()
            out[str(n)] = {"error": f"{type(e).__name__}: " + " | ".join(line for line in msg if "error" in line.lower())[:600]}
            print(n, out[str(n)]["error"], flush=True)
            continue
        sync()
        compile_s = time.perf_counter() - t0
        o_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[None, None, None], scale=scale, enable_gqa=True)
        arms = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=valid[None, None, None], scale=scale, enable_gqa=True),
            "flex": lambda: flex(q, k, v, block_mask=block, enable_gqa=True, scale=scale),
            "flex+mask": lambda: flex(q, k, v, block_mask=create_block_mask(mask_mod, None, None, 1, n, device=dev),
                                      enable_gqa=True, scale=scale),
        }
        for fn in arms.values():
            for _ in range(3):
                fn()
        rounds = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, fn in arms.items():
                sync()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                sync()
                rounds[name].append(1e6 * (time.perf_counter() - t0) / args.calls)
        med = {name: statistics.median(r) for name, r in rounds.items()}
        out[str(n)] = {"us_per_call": {"per_round": rounds, "median": med},
                       "flex_over_sdpa": med["flex"] / med["sdpa"], "flex_with_mask_over_sdpa": med["flex+mask"] / med["sdpa"],
                       "first_block_mask_s": first_mask_s, "flex_compile_s": compile_s,
                       "max_abs_diff_vs_sdpa": float((o_flex - o_sdpa).abs().max())}
        print(n, {k: round(v, 1) for k, v in med.items()}, flush=True)
    faster = all("error" not in r and r["flex_with_mask_over_sdpa"] < 1.0 for r in out.values())
    write_json(pathlib.Path(args.out), {**meta, "keys": out,
                                        "decision": "FlexAttention faster for a decode row: worth adopting" if faster
                                        else "SDPA kept: FlexAttention (with its per-step block mask) is not faster here, "
                                             "or does not compile"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
