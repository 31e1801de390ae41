"""Where a decode step's time goes, and whether torch.compile of the step's per-layer pieces pays.

1. Profile: SmolLM2 int4 decode steps (torch.profiler) at --contexts; per op: self time and
   calls per step; the step's wall time minus the summed op self times = Python/dispatch time.
2. Compile: the layer's work around attention as two functions of tensors only (input norm +
   fused qkv + RoPE; output projection + residual + norm + MLP), so one compiled graph serves
   every layer (static decode shapes). Step time eager vs compiled side by side, interleaved;
   exactness: the compiled pieces must give the eager logits bit for bit (the engine's steps
   are row-exact, so a compiled decode must match the eager verify rows too).
Writes results/research/profile_decode.json. Llama-family int4 only (the default model).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402


def decode_steps(model, kv, n, token=1234):
    from inference_engine.engine import steps

    ts = []
    for _ in range(n):
        t = time.perf_counter()
        steps.decode_step(model, kv, token)
        ts.append(time.perf_counter() - t)
    return ts


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def profile(model, engine, ctx, n):
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    kv = engine.new_session_kv()
    engine.prefill(kv, list(range(100, 100 + ctx)))
    decode_steps(model, kv, 5)
    wall = median(decode_steps(model, kv, 20))
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        decode_steps(model, kv, n)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    kernel_s = sum(e.self_cpu_time_total for e in ops) / 1e6 / n
    top = [{"op": e.key, "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / n, 3), "calls_per_step": e.count // n}
           for e in ops[:15]]
    calls = sum(e.count for e in ops) // n
    del torch
    return {"context": ctx, "step_ms_median": round(wall * 1e3, 2), "op_self_ms_per_step": round(kernel_s * 1e3, 2),
            "aten_calls_per_step": calls, "top_ops": top,
            "note": "op self times are measured under the profiler (slower than the plain median); the gap between "
                    "them and the step is Python and dispatch"}


class CompiledLayerPieces:
    """The model's project/position/finish for a Llama-family int4 model as compiled functions of
    tensors (layer weights passed in), swapped into the model object for the measurement."""

    def __init__(self, model):
        import torch

        from inference_engine.backends.torch.linear import GROUP

        s = model.spec
        if s.gemma_norms or s.qk_norm or model.weights != "int4":
            raise SystemExit("profile_decode's compiled pieces cover Llama-family int4 models only")
        self.model, self.eager = model, (model.project, model.position_q, model.position_k, model.finish)
        nq, nkv, hd, eps = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.head_dim, s.rms_eps

        def rms(x, w):
            xf = x.float()
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        def lin(x, packed, sz):
            return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP, sz).to(x.dtype)

        def pre(x, ln, packed, sz):
            t = x.shape[0]
            qkv = lin(rms(x, ln), packed, sz)
            q = qkv[:, :nq].view(t, -1, hd).transpose(0, 1)
            k = qkv[:, nq:nq + nkv].view(t, -1, hd).transpose(0, 1)
            v = qkv[:, nq + nkv:].view(t, -1, hd).transpose(0, 1)
            return q, k, v

        def post(x, o, wo_p, wo_s, gu_p, gu_s, dn_p, dn_s, ln):
            x = x + lin(o.transpose(0, 1).reshape(x.shape[0], -1), wo_p, wo_s)
            gu = lin(rms(x, ln), gu_p, gu_s)
            inter = gu.shape[-1] // 2
            return x + lin(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:], dn_p, dn_s)

        self.pre, self.post = torch.compile(pre, dynamic=False), torch.compile(post, dynamic=False)

    def install(self):
        m = self.model

        def project(i, x):
            L = m.layers[i]
            return self.pre(x, L.ln_in, L.wqkv.packed, L.wqkv.scale_zero)

        def finish(i, x, o):
            L = m.layers[i]
            return self.post(x, o, L.wo.packed, L.wo.scale_zero, L.w_gate_up.packed, L.w_gate_up.scale_zero,
                             L.w_down.packed, L.w_down.scale_zero, L.ln_post_attn)

        m.project, m.finish = project, finish

    def uninstall(self):
        m = self.model
        m.project, m.position_q, m.position_k, m.finish = self.eager


def logits_of(model, engine, prompt, tokens):
    import torch

    from inference_engine.engine import steps

    kv = engine.new_session_kv()
    engine.prefill(kv, prompt)
    out = []
    for t in tokens:
        steps.decode_step(model, kv, t)
        out.append(kv.last_logits.clone())
    return torch.stack(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--contexts", default="128,4096")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved eager/compiled rounds of --steps decode steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "profile_decode.json"))
    args = ap.parse_args()

    import pathlib

    import torch

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    model = TorchCausalLM.load(resolve_model(args.model), weights="int4")
    engine = Engine(model, KVStrategy("full"), prefill_chunk=512)
    contexts = [int(c) for c in args.contexts.split(",")]
    prof = [profile(model, engine, c, args.steps) for c in contexts]
    for p in prof:
        print(f"ctx {p['context']}: step {p['step_ms_median']} ms, ops {p['op_self_ms_per_step']} ms, "
              f"{p['aten_calls_per_step']} aten calls")

    pieces = CompiledLayerPieces(model)
    prompt, probe = list(range(200, 330)), [5, 17, 99, 1234, 42]
    ref = logits_of(model, engine, prompt, probe)
    pieces.install()
    t0 = time.perf_counter()
    got = logits_of(model, engine, prompt, probe)  # compiles
    compile_s = time.perf_counter() - t0
    pieces.uninstall()
    exact = bool(torch.equal(got, ref))
    timing = {}
    for c in contexts:
        kvs = {}
        for name in ("eager", "compiled"):
            kvs[name] = engine.new_session_kv()
            engine.prefill(kvs[name], list(range(100, 100 + c)))
        res = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            for name in ("eager", "compiled"):
                if name == "compiled":
                    pieces.install()
                res[name] += decode_steps(model, kvs[name], args.steps)
                pieces.uninstall()
        e, cpl = median(res["eager"]), median(res["compiled"])
        timing[str(c)] = {"eager_step_ms": round(e * 1e3, 2), "compiled_step_ms": round(cpl * 1e3, 2), "speedup": round(e / cpl, 3)}
        print(f"ctx {c}: eager {e * 1e3:.1f} ms, compiled {cpl * 1e3:.1f} ms ({e / cpl:.2f}x)")
    out = run_metadata(vars(args))
    out |= {"profile": prof, "compiled": {"pieces": "input norm + fused qkv (pre-RoPE) and o_proj + residual + norm + MLP, "
                                                    "one graph for all layers",
                                          "compile_seconds": round(compile_s, 1), "logits_bit_equal_to_eager": exact,
                                          "decode": timing,
                                          "kept": False,
                                          "rule": "kept only where faster at every context AND bit-equal "
                                                  "(the engine's steps are row-exact)"}}
    out["compiled"]["kept"] = exact and all(t["speedup"] > 1.0 for t in timing.values())
    write_json(pathlib.Path(args.out), out)
    print({"exact": exact, "compile_s": round(compile_s, 1), "timing": timing})
    return 0


if __name__ == "__main__":
    sys.exit(main())
