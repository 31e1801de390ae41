"""How near the CPU's own limits the native step runs (issue 28's AVX2 targets): memory for one decode row, the
vector units for each extra row of a verify block or a batch.

1. `ops`: the throughput of the AVX2 instructions the int4 kernel's row loop is made of (csrc/q4_matmul.h tile_avx2:
   vpmaddubsw, vpaddw, vpmaddwd), each in a loop of 12 independent chains (inline assembly), and of the kernel's own row mix in a loop
   of 8 independent rows (per row and plane: 8 x (vpbroadcastd from memory + vpmaddubsw), 7 x vpaddw, 1 x vpmaddwd;
   then the planes combined, converted and two fmas: one row of one 8-column half-block of one group of 32 inputs,
   256 weights x 2 planes). A small C file compiled here with the system compiler (-O3 -march=native, as the native step) and timed with
   the TSC, whose rate is measured against the wall clock. Nothing of it is in the product.
2. `kernel`: the real int4 kernel (q4_matmul, one thread, two activation planes as the daemon's default) over one
   in-cache matrix (576 x 576, SmolLM2's q/o size) at 1, 2, 5 and 8 rows: its time per extra row per (row, half-block,
   group), against the row mix's in part 1.
3. `memory`: what one decode row is bound by. The bytes a greedy decode step streams (the layers' int4 blocks and the
   head's 4-bit copy, from the native step's arenas), the step's median time (`full` at --context tokens, --steps
   steps, --threads threads), and the rate the machine reads those bytes at (torch sum of the same bytes in a 2 MB-page
   arena and in 4 KB pages, --threads threads).
4. `layers`: the layers' int4 matmuls of one row (the step's own blocks in layer order), streamed from memory as in a
   step, against the same work with the weights in cache, the calls alone (a tiny matrix as often) and torch reading
   the blocks: how well the kernel overlaps its memory reads with its arithmetic.
The kernel runs as the daemon runs it: a one-row call in one pass over each block of 16 columns (csrc/q4_matmul.h
row_avx2: both halves group by group) and, for calls of several rows, the second pass prefetching the next block
(prefetch_next). Parts 3 and 4 also time the decode step and the streamed matmuls as before them (two passes, no
next-block prefetch: q4_one_pass_row(0), q4_prefetch_next(0)) and, for the matmuls, two passes with the prefetch,
interleaved step by step.

Writes medians and the ratios (achieved over bound). Interleaved where it compares (kernel row counts; the two read
buffers).

    .venv/bin/python scripts/research/avx2_roofline.py --threads 2
"""
from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, fill_with_random_kv, run_metadata, write_json  # noqa: E402

OUT = ROOT / "results" / "research" / "avx2_roofline.json"

C_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <x86intrin.h>

uint64_t tsc(void) { return __rdtsc(); }

/* op(r_i, ymm15) on 12 registers ymm0..ymm11, 12 independent chains, in inline assembly (compilers spill such loops
   written with intrinsics). */
#define ASM12(I) I " %%ymm15, %%ymm0, %%ymm0\n" I " %%ymm15, %%ymm1, %%ymm1\n" I " %%ymm15, %%ymm2, %%ymm2\n" \
  I " %%ymm15, %%ymm3, %%ymm3\n" I " %%ymm15, %%ymm4, %%ymm4\n" I " %%ymm15, %%ymm5, %%ymm5\n" \
  I " %%ymm15, %%ymm6, %%ymm6\n" I " %%ymm15, %%ymm7, %%ymm7\n" I " %%ymm15, %%ymm8, %%ymm8\n" \
  I " %%ymm15, %%ymm9, %%ymm9\n" I " %%ymm15, %%ymm10, %%ymm10\n" I " %%ymm15, %%ymm11, %%ymm11\n"
#define LOOP(NAME, INSN) \
double NAME(long n) { \
  __asm__ volatile("vpcmpeqb %%ymm15, %%ymm15, %%ymm15\n" ::: "xmm15"); \
  uint64_t t0 = __rdtsc(); \
  for (long i = 0; i < n; ++i) \
    __asm__ volatile(ASM12(INSN) ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", \
                     "xmm10", "xmm11", "xmm15"); \
  uint64_t t1 = __rdtsc(); \
  __asm__ volatile("vzeroupper"); \
  return (double)(t1 - t0) / ((double)n * 12); \
}
LOOP(maddubs, "vpmaddubsw")
LOOP(paddw, "vpaddw")
LOOP(pmaddwd, "vpmaddwd")
LOOP(pand, "vpand")

/* The kernel's row mix: 8 rows, each two planes of 8 x (broadcast 4 activation bytes + maddubs), 7 adds, 1 madd, then
   the planes combined (shift, add), converted and two fmas into the row's float sums. acts: 8 rows x 2 planes x 32
   bytes, re-read every iteration (as the kernel reads each row's group from L1). Returns TSC cycles per row. */
double row_mix(long n, const int8_t* acts, float* out) {
  __m256i w[8];
  for (int c = 0; c < 8; ++c) w[c] = _mm256_set1_epi8((char)(c + 1));
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 d = _mm256_set1_ps(0.5f), m = _mm256_set1_ps(0.25f);
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  uint64_t t0 = __rdtsc();
  for (long i = 0; i < n; ++i) {
    for (int r = 0; r < 8; ++r) {
      const int8_t* xr = acts + r * 64;
      __m256i dot = _mm256_setzero_si256();
      for (int plane = 0; plane < 2; ++plane) {
        __m256i s[8];
        for (int c = 0; c < 8; ++c) {
          int32_t four;
          __builtin_memcpy(&four, xr + plane * 32 + 4 * c, 4);
          s[c] = _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(four));
        }
        const __m256i t = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(s[0], s[1]), _mm256_add_epi16(s[2], s[3])),
                                           _mm256_add_epi16(_mm256_add_epi16(s[4], s[5]), _mm256_add_epi16(s[6], s[7])));
        const __m256i p32 = _mm256_madd_epi16(t, ones);
        dot = plane ? _mm256_add_epi32(_mm256_slli_epi32(dot, 8), p32) : p32;
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(0.125f), acc[r]);
    }
    __asm__ volatile("" : : "r"(acts) : "memory");
  }
  uint64_t t1 = __rdtsc();
  for (int r = 0; r < 8; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
  return (double)(t1 - t0) / ((double)n * 8);
}
"""


def build_ops(cc: str) -> ctypes.CDLL:
    d = pathlib.Path(tempfile.mkdtemp(prefix="kakeya-roofline-"))
    src, lib = d / "ops.c", d / "ops.so"
    src.write_text(C_SOURCE)
    subprocess.run([cc, "-O3", "-march=native", "-mavx2", "-mfma", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    so = ctypes.CDLL(str(lib))
    so.tsc.restype = ctypes.c_uint64
    for name in ("maddubs", "paddw", "pmaddwd", "pand", "row_mix"):
        getattr(so, name).restype = ctypes.c_double
    return so


def tsc_hz(so: ctypes.CDLL) -> float:
    rates = []
    for _ in range(5):
        a, t0 = so.tsc(), time.perf_counter()
        while time.perf_counter() - t0 < 0.1:
            pass
        rates.append((so.tsc() - a) / (time.perf_counter() - t0))
    return statistics.median(rates)


def merge(files: list[str], out: str) -> int:
    """Runs of this script (other --context values, repeats) in one file, each whole with its provenance, and the
    next-block prefetch's ratios side by side."""
    import json

    runs = [json.loads(pathlib.Path(f).read_text()) | {"file": f} for f in files]
    summary = [{"file": r["file"], "commit": r["commit"], "context": r["memory"]["context"],
                "load_average_at_start": r["machine"]["load_average_at_start"],
                "decode_before_over_now": r["memory"]["decode_before_over_now"],
                "layers_streamed_before_over_now": r["layers"]["streamed_before_over_now"],
                "layers_streamed_two_passes_over_now": r["layers"]["streamed_two_passes_over_now"],
                "layers_streamed_over_max_of_compute_and_read": r["layers"]["streamed_over_max_of_compute_and_read"],
                "decode_step_time_over_read_time_2MB": r["memory"]["step_time_over_read_time_2MB"]} for r in runs]
    write_json(pathlib.Path(out), run_metadata({"merge": files}) | {"what": "avx2_roofline runs merged",
                                                                    "summary": summary, "runs": runs})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--merge", nargs="+", default=None, help="merge these runs' JSON files into --out and stop")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)

    import torch

    from inference_engine.backends.torch import hugepages, native
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.steps import StepInput, forward_batch
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    meta = run_metadata(vars(args))
    if meta["machine"]["cpu"].get("torch_cpu_capability") not in ("AVX2", "AVX512"):
        raise SystemExit("an x86 CPU with AVX2 is needed here")

    # 1: the instructions' throughput, and the kernel's row mix
    so = build_ops(args.cc)
    hz = tsc_hz(so)
    ops: dict = {}
    for name in ("maddubs", "paddw", "pmaddwd", "pand"):
        fn = getattr(so, name)
        fn(ctypes.c_long(2_000_000))
        cyc = statistics.median(fn(ctypes.c_long(20_000_000)) for _ in range(args.rounds))
        ops[name] = {"tsc_cycles_per_op": round(cyc, 4), "ops_per_ns": round(hz / 1e9 / cyc, 3)}
    acts = (ctypes.c_int8 * 512)(*[(i * 37) % 255 - 127 for i in range(512)])
    out = (ctypes.c_float * 64)()
    so.row_mix(ctypes.c_long(200_000), acts, out)
    mix_cyc = statistics.median(so.row_mix(ctypes.c_long(2_000_000), acts, out) for _ in range(args.rounds))
    row_mix_ns = mix_cyc / hz * 1e9  # one row of one 8-column half-block of one group (256 weights, 2 planes)

    # 2: the real kernel, one thread, one in-cache matrix
    torch.set_num_threads(1)
    module = native.load()
    if module is None:
        raise SystemExit("the native step is unavailable here (see the log)")
    n_out, k_in = 576, 576
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n_out, k_in), dtype=torch.uint8, generator=g)
    d = torch.rand(n_out, k_in // 32, generator=g) * 0.01
    w = module.q4_pack(codes, d, -8 * d)
    xs = {r: torch.randn(r, k_in, generator=g) for r in (1, 2, 5, 8)}
    times: dict = {r: [] for r in xs}
    for x in xs.values():
        for _ in range(50):
            module.q4_matmul(x, w, 0, 2)
    for _ in range(args.rounds):  # interleaved: each round every row count in turn
        for r, x in xs.items():
            t0 = time.perf_counter()
            for _ in range(400):
                module.q4_matmul(x, w, 0, 2)
            times[r].append((time.perf_counter() - t0) / 400)
    med = {r: statistics.median(v) for r, v in times.items()}
    halves = (n_out // 16) * (k_in // 32) * 2  # (row, half-block, group) units a row costs
    kernel = {"matrix": [n_out, k_in], "planes": 2, "threads": 1,
              "call_us": {str(r): round(v * 1e6, 2) for r, v in med.items()},
              "per_extra_row_us": {str(r): round((med[r] - med[1]) / (r - 1) * 1e6, 2) for r in med if r > 1}}
    per_unit = {r: (med[r] - med[1]) / (r - 1) / halves * 1e9 for r in med if r > 1}
    kernel["per_extra_row_ns_per_unit"] = {str(r): round(v, 3) for r, v in per_unit.items()}
    kernel["row_mix_ns_per_unit"] = round(row_mix_ns, 3)
    kernel["row_mix_over_kernel_per_extra_row_at_8"] = round(row_mix_ns / per_unit[8], 3)

    # 3: memory: one decode row's bytes and time against the machine's read rate
    torch.set_num_threads(args.threads)
    model = TorchCausalLM.load(resolve_model(args.model), weights="int4")
    if not model.use_native_step():
        raise SystemExit("the native step is unavailable here (see the log)")
    st = model.native_step
    layer_bytes = st.arena.nbytes if st.arena is not None else 0
    head_bytes = st.head_arena.nbytes // 2 if st.head_arena is not None else 0  # greedy steps read the 4-bit copy only
    step_bytes = layer_bytes + head_bytes
    cache = make_cache(KVStrategy("full"), model.geometry(), max_step=256, max_context=model.spec.max_context)
    fill_with_random_kv(cache, args.context, 256, torch.Generator().manual_seed(1))
    token = model.tensor([17])

    def step() -> float:  # a greedy decode step, as the engine runs one (the greedy head), then aborted
        at = cache.next_position
        t0 = time.perf_counter()
        forward_batch(model, [StepInput(token, range(at, at + 1), cache, "last", row_exact=True, greedy=True)])
        took = time.perf_counter() - t0
        cache.abort()
        return took

    src = torch.randint(-2**62, 2**62, (step_bytes // 8,), dtype=torch.int64, generator=g)
    huge = hugepages.Arena([src], huge=True)
    plain = src.clone()  # torch's allocator: 4 KB pages here (THP `madvise`)
    bufs = {"2MB_pages": huge.views[0], "4KB_pages": plain}
    reads: dict = {k: [] for k in bufs}
    steps_s: list = []
    steps_off: list = []  # the same step with the kernel as before (two passes a block, no next-block prefetch)

    def as_before(fn, one_pass: int = 0, nxt: int = 0):
        module.q4_one_pass_row(one_pass)
        module.q4_prefetch_next(nxt)
        try:
            return fn()
        finally:
            module.q4_one_pass_row(1)
            module.q4_prefetch_next(1)

    for _ in range(5):
        step()
    for _ in range(args.steps):
        steps_s.append(step())
        steps_off.append(as_before(step))
        for k, b in bufs.items():
            t0 = time.perf_counter()
            b.sum()
            reads[k].append(time.perf_counter() - t0)
    step_s = statistics.median(steps_s)
    step_off_s = statistics.median(steps_off)

    # the layers' int4 matmuls of one row (the step's own blocks, in layer order, two planes), --threads threads:
    # streamed from memory as in a step; with their weights in cache (layer 0's matrices as often as there are
    # layers: the same work); as many calls of a tiny matrix (the Python call's own cost); and torch reading the blocks
    blocks = list(st.arena.views) if st.arena is not None else []
    per_layer = len(blocks) // model.spec.num_layers
    hot = blocks[:per_layer] * model.spec.num_layers
    row = {id(b): torch.randn(1, b.shape[1] * 32, generator=g) for b in blocks}
    tiny_w, tiny_x = blocks[0][:1].contiguous(), torch.randn(1, blocks[0].shape[1] * 32, generator=g)
    arena_words = st.arena.base[: st.arena.nbytes // 8 * 8].view(torch.int64)

    def layers(ws) -> float:
        t0 = time.perf_counter()
        for b in ws:
            module.q4_matmul(row[id(b)] if id(b) in row else tiny_x, b, 0, 2)
        return time.perf_counter() - t0

    def read_blocks() -> float:
        t0 = time.perf_counter()
        arena_words.sum()
        return time.perf_counter() - t0

    cells = {"streamed": lambda: layers(blocks),
             "streamed_two_passes": lambda: as_before(lambda: layers(blocks), 0, 1),
             "streamed_before": lambda: as_before(lambda: layers(blocks)),
             "in_cache": lambda: layers(hot),
             "calls_only": lambda: layers([tiny_w] * len(blocks)), "torch_read_of_the_blocks": read_blocks}
    lay: dict = {k: [] for k in cells}
    for _ in range(3):
        for f in cells.values():
            f()
    for _ in range(args.steps // 2):
        for k, f in cells.items():
            lay[k].append(f())
    lay_ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in lay.items()}
    layers_part = {"blocks": len(blocks), "block_bytes": layer_bytes, "rows": 1, "threads": args.threads, "ms": lay_ms,
                   "streamed_over_max_of_compute_and_read": round(
                       (lay_ms["streamed"] - lay_ms["calls_only"])
                       / max(lay_ms["in_cache"] - lay_ms["calls_only"], lay_ms["torch_read_of_the_blocks"]), 3),
                   "streamed_before_over_now": round(lay_ms["streamed_before"] / lay_ms["streamed"], 3),
                   "streamed_two_passes_over_now": round(lay_ms["streamed_two_passes"] / lay_ms["streamed"], 3)}
    read_gbs = {k: round(step_bytes / statistics.median(v) / 1e9, 2) for k, v in reads.items()}
    memory = {"step_bytes": step_bytes, "layer_block_bytes": layer_bytes, "head_4bit_bytes": head_bytes,
              "context": args.context, "threads": args.threads, "decode_step_ms": round(step_s * 1e3, 3),
              "decode_step_ms_before": round(step_off_s * 1e3, 3),
              "decode_before_over_now": round(step_off_s / step_s, 3),
              "step_gb_s": round(step_bytes / step_s / 1e9, 2), "read_gb_s": read_gbs,
              "huge_page_bytes_of_read_buffer": huge.huge_bytes(),
              "step_time_over_read_time_2MB": round(step_s / statistics.median(reads["2MB_pages"]), 3)}

    doc = meta | {"tsc_hz": round(hz), "ops": ops, "kernel": kernel, "memory": memory, "layers": layers_part,
                  "what": "ops: AVX2 instruction throughput (12 independent chains) and the int4 kernel's row mix "
                          "(8 independent rows); kernel: q4_matmul's time per extra row per (row, 8-column half-block, "
                          "32-input group) unit against the row mix's; memory: a greedy decode step's streamed bytes "
                          "over its time against torch's read rate of as many bytes; layers: one row's int4 matmuls "
                          "streamed, in cache, the calls alone, and the blocks read by torch"}
    write_json(pathlib.Path(args.out), doc)
    print({"ops": ops, "kernel": kernel, "memory": memory, "layers": layers_part})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
