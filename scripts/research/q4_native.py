"""A native int4 kernel (q4_native/q4_matmul.cpp) against torch's `_weight_int4pack_mm_for_cpu`, per
number of activation rows M: is it worth putting in the product (issue 28 item 3)?

The kernel computes a Q4_1 matrix (GGUF's 4-bit blocks) times activations quantized to int8 per block
of 32, with integer dot products (AVX-512 VNNI `vpdpbusd`, or AVX2 `maddubs`/`madd`) and one float fma
per block - llama.cpp's way, written for this project. By construction every output element is the
same sequence of float operations whatever M, the thread count or the ISA, so rows are independent
(what batching and row-exact verify need); this script checks that (rows alone == rows in a batch,
scalar == AVX2 == VNNI, bit for bit) and measures, on SmolLM2's two matrix shapes, the median time
of both kernels at M = 1, 2, 4, 8, 16 with 1 and 2 threads, and each one's max error against the
fp64 product of the same dequantized weights (the native one also quantizes activations to int8).

Built with torch's C++ extension loader (ninja, the machine's C++ compiler) into a temporary directory.

    python scripts/research/q4_native.py --out results/research/q4_native.json
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402

SOURCE = pathlib.Path(__file__).with_name("q4_native") / "q4_matmul.cpp"
ISAS = {0: "scalar", 1: "AVX2", 2: "AVX-512 VNNI"}


def build():
    from torch.utils import cpp_extension

    t = time.perf_counter()
    mod = cpp_extension.load(name="kakeya_q4_research", sources=[str(SOURCE)], build_directory=tempfile.mkdtemp(),
                             extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"])
    return mod, time.perf_counter() - t


def pack(codes, d):
    """codes (N, K) in 0..15, d (N, K/32) -> (N, K/32 * 18) uint8: per block d (fp16), then byte j = q[j] | q[16 + j] << 4."""
    import torch

    n, k = codes.shape
    b = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    nib = b[:, :, 0] | (b[:, :, 1] << 4)
    dh = d.to(torch.float16).contiguous().view(torch.uint8).view(n, k // 32, 2)
    return torch.cat([dh, nib], -1).reshape(n, k // 32 * 18).contiguous()


def median_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "q4_native.json"))
    args = p.parse_args(argv)

    import torch

    from inference_engine.backends.torch.linear import Int4Linear, quantize_q4_1

    meta = run_metadata(vars(args))
    mod, build_s = build()
    best = int(mod.best_isa())
    isas = list(range(best + 1))
    torch.manual_seed(0)
    shapes = {"gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536)}
    out: dict = {}
    checks = {"rows_independent": True, "isas_bit_equal": True}
    for name, (n, k) in shapes.items():
        q, d, m = quantize_q4_1(torch.randn(n, k))
        d16, m16 = d.half(), m.half()
        w = pack(q, d16)
        torch_lin = Int4Linear.from_blocks(q, d16.float(), m16.float())
        deq = (q.float().view(n, k // 32, 32) * d16.float()[..., None] + m16.float()[..., None]).view(n, k).double()
        rows = {}
        for mrows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(mrows, k)
            ref = x.double() @ deq.T
            y = mod.q4_matmul(x, w, m16, -1)
            checks["isas_bit_equal"] &= all(torch.equal(y, mod.q4_matmul(x, w, m16, i)) for i in isas)
            checks["rows_independent"] &= all(torch.equal(mod.q4_matmul(x[i:i + 1], w, m16, -1), y[i:i + 1]) for i in range(mrows))
            row = {"max_rel_err_native": ((y.double() - ref).abs().max() / ref.abs().max()).item(),
                   "max_rel_err_torch": ((torch_lin(x).double() - ref).abs().max() / ref.abs().max()).item()}
            for th in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(th)
                nat = median_us(lambda: mod.q4_matmul(x, w, m16, -1), args.reps)
                tor = median_us(lambda: torch_lin(x), args.reps)
                row[f"t{th}"] = {"native_us": round(nat, 1), "torch_us": round(tor, 1), "native_speedup": round(tor / nat, 3)}
            rows[str(mrows)] = row
            print(name, mrows, row, flush=True)
        out[name] = rows
    speedups = [v["native_speedup"] for s in out.values() for r in s.values() for key, v in r.items() if key.startswith("t")]
    doc = meta | {"build_seconds": round(build_s, 1), "isa": ISAS[best], "checks": checks, "by_shape": out,
                  "native_speedup_range": [min(speedups), max(speedups)],
                  "verdict": "faster than torch's kernel at every shape, row count and thread count measured"
                  if min(speedups) >= 1.0 else "not faster everywhere: kept out of the product (torch's kernel stays)"}
    write_json(pathlib.Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
