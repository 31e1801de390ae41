"""The native CPU row step (inference_engine/backends/torch/native.py) against the Python pieces, side by side.

Arms, one int4 model (the GGUF's Q4_1 blocks), every step a decode step (`steps.decode_step`, greedy scoring):
  python         the layer pieces driven from Python (--compile off)
  native-torchk  the native row step with torch's int4 kernel (_weight_int4pack_mm_for_cpu, bf16 activations) inside
  native-q4      the native row step with its own int4 kernel (csrc/q4_matmul.h: activations as two int8 planes)
                 for the layers and the head's greedy scoring (one plane there) (--compile auto's default until 2026-11-29)
  native-q4-one-plane  the same with one int8 plane in the layers too (int8 activations, as llama.cpp's Q8)
  native-q4-outliersC  (--outliers C,..) one plane, and each linear's C outlier input channels (native.outlier_channels:
                 the largest |activations| over seeded random token ids) taken out of it and added exactly (C = 16:
                 --compile auto's default since 2026-11-29, native.PLANES / native.OUTLIERS)
  llama.cpp      (--llama-cpp, quality only) llama-cpp-python on the model directory's source.gguf (the file the
                 llama.cpp benches run; its AVX2 path quantizes activations to Q8 blocks), every position a one-token
                 decode, as the peer's own quality on the same positions
  native-q4+kv_fp16  (--kv-fp16) native-q4 over fp16 resident K/V (--kv-dtype fp16: the slabs half the bytes,
                 attention in fp32 on the stored values); every other arm reads fp32 K/V
  native-q4+attn_avx2, native-q4+kv_fp16+attn_avx2  (--attention-avx2, an AVX-512 build's machine) the same steps
                 with the AVX2 attention code (row_attention(1)) instead of the build's 16-lane one (the default there;
                 the bits differ: another sum order), over fp32 and (with --kv-fp16) fp16 K/V
  planes-ABCD    (--plane-arms, quality only) activation planes per matrix kind: wqkv A, wo B, w_gate_up C,
                 w_down D (e.g. 1112: two planes in w_down only), to see whether some matrices can take one
Measured:
  1. quality: teacher-forced top-1 agreement with fp32 (bench_weights.py's held-out prompts and fp32's greedy
     continuations, --tokens positions each), every position a decode step of the arm; the gate the weight
     formats pass: >= 99 %. Also the int4 prefill path (one forward per sequence), as bench_weights measures it.
  2. decode: median ms per step after --contexts tokens, per --threads, arms interleaved in rounds.
  3. the kernel: torch's int4 kernel vs the q4 kernel (two planes; one plane too) on SmolLM2's matrices for 1..16
     rows (a verify block is 5).
  4. (--prefetch B1,B2,..) the q4 kernel's prefetch distance: every layer's matmuls in turn for --rows rows, so the
     weights stream from memory as in a step, per --threads, distances interleaved in --rounds (median ms).
Writes results/research/native_step.json.

    python scripts/research/native_step.py --threads 1,2
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402

ARMS = ("python", "native-torchk", "native-q4", "native-q4-one-plane")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=40, help="held-out prompts (half chat, half code)")
    ap.add_argument("--tokens", type=int, default=64, help="teacher-forced positions per prompt")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,2,5,8,16", help="rows per call in the kernel comparison")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--prefetch", default="", help="prefetch distances in bytes to compare, e.g. 0,1024,2048,3072")
    ap.add_argument("--outliers", default="", help="arms with one plane and C outlier channels each, e.g. 16,32")
    ap.add_argument("--plane-arms", default="", help="extra quality arms, planes per matrix kind, e.g. 1112,1122")
    ap.add_argument("--quality-arms", default="", help="only these arms' quality (comma list; default all)")
    ap.add_argument("--decode-arms", default="", help="only these arms' decode (comma list; default all)")
    ap.add_argument("--kv-fp16", action="store_true", help="an arm: native-q4 over fp16 resident K/V (--kv-dtype fp16)")
    ap.add_argument("--attention-avx2", action="store_true",
                    help="arms with the AVX2 attention code where the build's default is the 16-lane one (AVX-512)")
    ap.add_argument("--llama-cpp", action="store_true", help="a quality arm: llama.cpp on the same GGUF, same positions")
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "native_step.json"))
    args = ap.parse_args(argv)

    import torch

    from bench_weights import fp32_references, full_logits
    from inference_engine.backends.torch import native
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine import steps
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    meta = run_metadata(vars(args))
    threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(threads[0])
    path = resolve_model(args.model)
    mod = native.load()
    if mod is None:
        raise SystemExit(f"the native row step did not build here: {native.unavailable_reason()}")
    m = TorchCausalLM.load(path, weights="int4")
    setups = {"python": (None, None)}
    m.use_native_step(q4=False)
    setups["native-torchk"] = (m.native_step, None)
    m.use_native_step(q4=True, planes=1, outliers=0)
    setups["native-q4-one-plane"] = (m.native_step, m.head.greedy_kernel)
    outlier_arms = []
    for c in (int(c) for c in args.outliers.split(",") if c):
        m.use_native_step(q4=True, planes=1, outliers=c)
        outlier_arms.append(f"native-q4-outliers{c}")
        setups[outlier_arms[-1]] = (m.native_step, m.head.greedy_kernel)
    m.use_native_step(q4=True, planes=2)
    setups["native-q4"] = (m.native_step, m.head.greedy_kernel)
    kv_arms = ["native-q4+kv_fp16"] if args.kv_fp16 else []
    default_attention = mod.row_attention(-1)
    if args.attention_avx2 and default_attention == 1:
        raise SystemExit("--attention-avx2: this build's attention is the AVX2 code already (no AVX-512)")
    attn_arms = [f"{a}+attn_avx2" for a in ("native-q4", *kv_arms)] if args.attention_avx2 else []
    for arm in (*kv_arms, *attn_arms):
        setups[arm] = setups["native-q4"]
    arms = (*ARMS, *outlier_arms, *kv_arms, *attn_arms)

    plane_arms = [f"planes-{a}" for a in args.plane_arms.split(",") if a]
    for arm in plane_arms:
        m.use_native_step(q4=True, planes=tuple(int(c) for c in arm.removeprefix("planes-")), outliers=0)
        setups[arm] = (m.native_step, m.head.greedy_kernel)
    m.native_step, m.head.greedy_kernel = setups["native-q4"]

    def use(arm):
        m.native_step, m.head.greedy_kernel = setups[arm]
        mod.row_attention(1 if arm.endswith("+attn_avx2") else default_attention)

    engines = {dt: Engine(m, KVStrategy("full", kv_dtype=dt), prefill_chunk=256) for dt in ("fp32", "fp16")}

    def engine_for(arm):  # the arm's resident K/V: fp16 for the +kv_fp16 arm, fp32 for every other
        return engines["fp16" if "+kv_fp16" in arm else "fp32"]

    out = meta | {"q4_isa": {0: "none", 1: "AVX2", 2: "AVX-512 VNNI"}[mod.q4_isa()], "build_dir": str(native.build_dir()),
                  "default_attention": {0: "16-lane", 1: "AVX2"}[default_attention]}

    # 1. quality
    if not args.skip_quality:
        seqs = fp32_references(path, args.prompts, args.tokens)
        quality = {}
        only = set(a for a in args.quality_arms.split(",") if a)
        if only - set(arms) - set(plane_arms):
            raise SystemExit(f"--quality-arms: no such arm {sorted(only - set(arms) - set(plane_arms))}")
        for arm in (*arms, *plane_arms):
            if only and arm not in only:
                continue
            use(arm)
            engine = engine_for(arm)
            agree = total = 0
            for p, cont, want in seqs:
                kv = engine.new_session_kv()
                engine.prefill(kv, p[:-1])
                for i, t in enumerate([p[-1], *cont[:-1]]):
                    steps.decode_step(m, kv, t, greedy=True)
                    agree += int(kv.last_logits.argmax()) == want[i]
                    total += 1
            quality[arm] = {"top1_agreement_with_fp32": round(agree / total, 5), "positions": total,
                            "passes_99_gate": agree / total >= 0.99}
            print(arm, quality[arm], flush=True)
        if args.llama_cpp:
            quality["llama.cpp"] = llama_cpp_agreement(path / "source.gguf", seqs, threads[0])
            print("llama.cpp", quality["llama.cpp"], flush=True)
        use("python")
        agree = total = 0
        for p, cont, want in seqs:
            got = full_logits(m, p + cont)[len(p) - 1: len(p) - 1 + len(cont)].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(got, want))
            total += len(want)
        quality["int4-prefill-path"] = {"top1_agreement_with_fp32": round(agree / total, 5), "positions": total}
        out["quality"] = quality

    # 2. decode
    if not args.skip_decode:
        contexts = [int(c) for c in args.contexts.split(",")]
        decode_arms = [a for a in arms if a in set(args.decode_arms.split(","))] if args.decode_arms else list(arms)
        if args.decode_arms and set(args.decode_arms.split(",")) - set(decode_arms):
            raise SystemExit(f"--decode-arms: no such arm {sorted(set(args.decode_arms.split(',')) - set(decode_arms))}")
        decode = {}
        for nt in threads:
            torch.set_num_threads(nt)
            sessions = {}
            for arm in decode_arms:
                use(arm)
                engine = engine_for(arm)
                for c in contexts:
                    kv = engine.new_session_kv()
                    engine.prefill(kv, [(7 * i + 3) % 1000 + 100 for i in range(c)])
                    steps.decode_step(m, kv, 1234, greedy=True)
                    sessions[arm, c] = kv
            times: dict = {key: [] for key in sessions}
            for _ in range(args.rounds):
                for (arm, c), kv in sessions.items():
                    use(arm)
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        steps.decode_step(m, kv, int(kv.last_logits.argmax()), greedy=True)
                        times[arm, c].append(time.perf_counter() - t)
            row = {}
            for c in contexts:
                ms = {arm: round(statistics.median(times[arm, c]) * 1e3, 3) for arm in decode_arms}
                row[str(c)] = {"step_ms_median": ms}
                if "python" in ms:
                    row[str(c)] |= {f"{arm.replace('-', '_')}_speedup_vs_python": round(ms["python"] / ms[arm], 3)
                                    for arm in ("native-q4", "native-q4-one-plane", "native-torchk") if arm in ms}
                if "native-q4" in ms:
                    row[str(c)] |= {f"{arm}_speedup_vs_native_q4": round(ms["native-q4"] / ms[arm], 3)
                                    for arm in (*outlier_arms, *kv_arms, *attn_arms) if arm in ms}
                print(f"threads {nt} ctx {c}", row[str(c)], flush=True)
            decode[str(nt)] = row
        out["decode"] = decode

    # 3. the kernel
    if not args.skip_kernel:
        from inference_engine.backends.torch.linear import Int4Linear

        L = m.layers[0]
        shapes = {"qkv": L.wqkv, "o": L.wo, "gate_up": L.w_gate_up, "down": L.w_down, "head": m.head.greedy_approx}
        kernel = {}
        for nt in threads:
            torch.set_num_threads(nt)
            for name, lin in shapes.items():
                assert isinstance(lin, Int4Linear)
                packed = native.q4_pack(mod, lin)
                n, k = lin.shape
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                    reps = 20 if n > 10000 else 200
                    res = {}
                    for label, fn in (("torch_us", lambda: lin(x)), ("q4_us", lambda: mod.q4_matmul(x, packed)),
                                      ("q4_one_plane_us", lambda: mod.q4_matmul(x, packed, 0, 1))):
                        for _ in range(5):
                            fn()
                        t = time.perf_counter()
                        for _ in range(reps):
                            fn()
                        res[label] = round((time.perf_counter() - t) / reps * 1e6, 1)
                    want = x @ lin.dequantized().T
                    res["q4_max_rel_err"] = round(float((mod.q4_matmul(x, packed) - want).abs().max() / want.abs().max()), 5)
                    res["q4_one_plane_max_rel_err"] = round(float((mod.q4_matmul(x, packed, 0, 1) - want).abs().max()
                                                                  / want.abs().max()), 5)
                    res["torch_max_rel_err"] = round(float((lin(x) - want).abs().max() / want.abs().max()), 5)
                    res["speedup"] = round(res["torch_us"] / res["q4_us"], 3)
                    kernel[f"t{nt} {name} {n}x{k} rows={rows}"] = res
                    print(nt, name, rows, res, flush=True)
        out["kernel"] = kernel
    # 4. prefetch distance, weights streamed
    if args.prefetch:
        packs = [native.q4_pack(mod, lin) for L in m.layers for lin in (L.wqkv, L.wo, L.w_gate_up, L.w_down)]
        default = mod.q4_prefetch()
        distances = [int(b) for b in args.prefetch.split(",")]
        streamed: dict = {"default_bytes": default, "weights_mb": round(sum(p.numel() for p in packs) / 2 ** 20, 1)}
        for nt in threads:
            torch.set_num_threads(nt)
            times: dict = {}
            for _ in range(args.rounds * 2):
                for b in distances:
                    mod.q4_prefetch(b)
                    for rows in (int(r) for r in args.rows.split(",")):
                        xs = {p.size(1) * 32: torch.randn(rows, p.size(1) * 32) for p in packs}
                        t = time.perf_counter()
                        for p in packs:
                            mod.q4_matmul(xs[p.size(1) * 32], p)
                        times.setdefault((b, rows), []).append(time.perf_counter() - t)
            row = {f"rows={r} prefetch={b}": round(statistics.median(v) * 1e3, 3) for (b, r), v in sorted(times.items())}
            streamed[f"t{nt}"] = row
            print(nt, row, flush=True)
        mod.q4_prefetch(default)
        out["prefetch_streamed_ms"] = streamed
    write_json(pathlib.Path(args.out), out)
    return 0


def llama_cpp_agreement(gguf: pathlib.Path, seqs, threads: int) -> dict:
    """llama.cpp's top-1 agreement with fp32 on the same teacher-forced positions: each prompt but its last token as one
    batch, then every position a one-token eval (llama.cpp's decode path), its logits' argmax against fp32's."""
    import llama_cpp
    import numpy as np

    if not gguf.is_file():
        raise SystemExit(f"--llama-cpp: {gguf} is missing (the model directory keeps the GGUF it was pulled from)")
    # logits_all: llama-cpp-python 0.3.x keeps no logits after eval() without it (sampling moved into its sampler)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512,
                          logits_all=True, verbose=False)
    agree = total = 0
    for p, cont, want in seqs:
        llm.reset()
        llm.eval(p[:-1])
        for i, t in enumerate([p[-1], *cont[:-1]]):
            llm.eval([t])
            row = llm.scores[llm.n_tokens - 1]
            if not row.any():
                raise SystemExit("llama.cpp returned no logits for a position")
            agree += int(np.argmax(row)) == want[i]
            total += 1
    return {"top1_agreement_with_fp32": round(agree / total, 5), "positions": total, "passes_99_gate": agree / total >= 0.99,
            "gguf": gguf.name, "llama_cpp_version": llama_cpp.__version__}


if __name__ == "__main__":
    raise SystemExit(main())
