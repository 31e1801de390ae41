"""MLX backend vs torch backend, side by side in one run: the agreement gate and speed.

For each weight format in `--formats` (fp32, int4; the same format on both backends):
  - reference: the torch backend's greedy continuation (Engine.generate, `full` cache) of each
    held-out prompt (bench_weights.held_out: half chat, half code), `--tokens` tokens;
  - agreement (ADR 0008 §11.8 criterion 5): the MLX backend runs the same engine steps on the same
    tokens (prefill_chunk of the prompt, then decode_step feeding each reference token), and its
    argmax at each of the `--tokens` positions is compared with torch's (= the reference token).
    Gate: >= 99 % of positions. Up to the first disagreement this is exactly MLX's own greedy
    generation (same steps, same inputs), so a prompt whose positions all agree is a greedy
    generation identical to torch's; every other prompt's MLX greedy generation is run in full
    and compared, and its first divergence is reported with both backends' top-2 logit margin
    there (a near-tie when small). Gate: >= 45 of 50 identical;
  - weights: max |W - W_pulled_fp32| of the MLX and torch int4 linears (both built from the GGUF's
    Q4_1 blocks with torch's bf16 scale/zero), max |W_mlx - W_torch| (0 when MLX int4 computes with
    torch int4's weights), and how many outputs of every linear layer differ between the backends
    on random inputs (0 when MLX int4 reproduces torch's kernel, bf16 activations included);
  - speed: prefill tok/s of a `--prefill` token prompt and decode tok/s (bench_weights.decode_and_prefill),
    both backends in this process, best of two alternating rounds; torch at `--threads` (default 1: MLX's
    CPU backend runs one thread). Measured on THIS machine's CPU (Linux x86, MLX's CPU backend,
    which runs one thread and whose x86 kernels are unoptimised upstream); Apple Silicon is not
    measured here.

    .venv/bin/python scripts/bench_mlx.py     # -> results/bench_mlx.json + .png
    # or one format per process (2 cores), then merged:
    .venv/bin/python scripts/bench_mlx.py --formats fp32 --out results/parts/bench_mlx/fp32.json
    .venv/bin/python scripts/bench_mlx.py --formats int4 --out results/parts/bench_mlx/int4.json
    .venv/bin/python scripts/bench_mlx.py --control --out results/parts/bench_mlx/int4_control.json
    .venv/bin/python scripts/bench_mlx.py --probe --prompts 3 --out results/parts/bench_mlx/probe.json
    .venv/bin/python scripts/bench_mlx.py --merge results/parts/bench_mlx/*.json

`--control` (no MLX): torch int4 against torch int4 with an ulp-level change to its RMSNorm
(run_control), the same measures, as the yardstick for the int4 greedy gate: int4 rounds
activations to bf16 before every linear, so any fp32-ulp difference between two
implementations (two frameworks' attention, norm, RoPE kernels) flips some roundings and the
two greedy runs part at the next near-tie. `--probe`: where the two backends part, layer by
layer, per format (run_probe).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_common import run_metadata, write_json  # noqa: E402
from bench_weights import decode_and_prefill, held_out  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--formats", default="fp32,int4")
    ap.add_argument("--prompts", type=int, default=50, help="held-out prompts (half chat, half code)")
    ap.add_argument("--tokens", type=int, default=64, help="positions per prompt")
    ap.add_argument("--prefill", type=int, default=512, help="prompt length for prefill tok/s")
    ap.add_argument("--decode", type=int, default=64, help="tokens for decode tok/s")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads; default 1, as MLX's CPU backend runs (and 2 threads stall on a shared 2-core box)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_mlx.json"))
    ap.add_argument("--merge", nargs="+", metavar="PART", help="merge part JSONs (one format each) into --out (+ PNG)")
    ap.add_argument("--probe", action="store_true",
                    help="instead of the gate: where torch and MLX part, layer by layer, on --prompts prompts, per --formats (run_probe)")
    ap.add_argument("--control", action="store_true",
                    help="instead of MLX: the int4 control, torch int4 vs torch int4 with an ulp-level RMSNorm change (run_control)")
    return ap.parse_args(argv)


def greedy(engine, prompt: list, n: int) -> list:
    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.requests import GenerateParams

    return [e.token_id for e in engine.generate(engine.new_session_kv(), prompt, GenerateParams(max_tokens=n))
            if isinstance(e, TokenGenerated)]


def teacher_forced(engine, prompt: list, cont: list) -> torch.Tensor:
    """(len(cont), V) host logits scoring each token of `cont`, through the engine's own steps."""
    from inference_engine.engine import steps

    kv = engine.new_session_kv()
    for i in range(0, len(prompt), engine.prefill_chunk):
        steps.prefill_chunk(engine.model, kv, prompt[i : i + engine.prefill_chunk])
    rows = [kv.last_logits]
    for t in cont[:-1]:
        steps.decode_step(engine.model, kv, t)
        rows.append(kv.last_logits)
    return torch.stack(rows)


def margin(row: torch.Tensor) -> float:
    top = row.topk(2).values
    return float(top[0] - top[1])


def linear_diffs(model, ref) -> float:
    """max |W_model - W_ref| over every linear layer (both dequantized to fp32 torch)."""
    import numpy as np

    def host(w):
        return w if isinstance(w, torch.Tensor) else torch.from_numpy(np.array(w))

    worst = 0.0
    for L, R in zip(model.layers, ref.layers):
        for a, b in ((L.wqkv, R.wqkv), (L.wo, R.wo), (L.w_gate_up, R.w_gate_up), (L.w_down, R.w_down)):
            worst = max(worst, float((host(a.dequantized()) - host(b.dequantized())).abs().max()))
    return worst


def linear_outputs_unequal(model, ref, rows: int = 3) -> dict:
    """Outputs of every linear layer that differ between the backends on the same random inputs."""
    import mlx.core as mx
    import numpy as np

    g = np.random.default_rng(0)
    unequal = total = 0
    for L, R in zip(model.layers, ref.layers):
        for a, b in ((L.wqkv, R.wqkv), (L.wo, R.wo), (L.w_gate_up, R.w_gate_up), (L.w_down, R.w_down)):
            x = g.standard_normal((rows, b.dequantized().shape[1])).astype(np.float32)
            ym, yt = np.array(a(mx.array(x))), b(torch.from_numpy(x)).numpy()
            unequal, total = unequal + int((ym != yt).sum()), total + ym.size
    return {"unequal": unequal, "total": total}


def measure_speed(fmt: str, models: dict, args) -> dict:
    """Best of two alternating rounds per backend (the 2-core machine is shared)."""
    warm = argparse.Namespace(prefill=16, decode=4)
    arms = {"torch": (models["torch"], args.threads), "mlx": (models["mlx"], args.threads)}
    best: dict = {}
    for model, threads in arms.values():
        torch.set_num_threads(threads)
        decode_and_prefill(model, warm)
    for _ in range(2):
        for name, (model, threads) in arms.items():
            torch.set_num_threads(threads)
            r = decode_and_prefill(model, args)
            print(fmt, name, r, flush=True)
            b = best.setdefault(name, r | {"torch_threads": threads})
            b["prefill_tok_s"] = max(b["prefill_tok_s"], r["prefill_tok_s"])
            if r["decode_tok_s"] > b["decode_tok_s"]:
                b["decode_tok_s"], b["decode_ms_per_token"] = r["decode_tok_s"], r["decode_ms_per_token"]
    torch.set_num_threads(args.threads)
    return best


def run_format(fmt: str, path, prompts: list, args, checkpoint=lambda row: None) -> dict:
    """The format's row; `checkpoint(row)` is called with the partial row after each prompt (a run cut
    short by the clock still leaves its measured prompts, marked incomplete)."""
    from inference_engine.backends.mlx.model import MlxCausalLM
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy

    tm, mm = TorchCausalLM.load(path, weights=fmt), MlxCausalLM.load(path, weights=fmt)
    te, me = (Engine(m, KVStrategy("full"), prefill_chunk=256) for m in (tm, mm))
    out = {"mlx_int4_from": mm.int4_source if fmt == "int4" else None}
    if fmt == "int4":
        tref, mref = TorchCausalLM.load(path, weights="fp32"), MlxCausalLM.load(path, weights="fp32")
        out["mlx_int4_vs_pulled_fp32_max_abs_diff"] = linear_diffs(mm, mref)
        out["torch_int4_vs_pulled_fp32_max_abs_diff"] = linear_diffs(tm, tref)
        out["mlx_int4_vs_torch_int4_max_abs_diff"] = linear_diffs(mm, tm)
        out["mlx_vs_torch_int4_linear_outputs_on_random_inputs"] = linear_outputs_unequal(mm, tm)
        del tref, mref
    # speed first: the agreement loop is the long part (MLX's x86 CPU kernels are slow)
    out["speed"] = speed = measure_speed(fmt, {"torch": tm, "mlx": mm}, args)
    out["mlx_vs_torch_decode"] = speed["mlx"]["decode_tok_s"] / speed["torch"]["decode_tok_s"]
    out["mlx_vs_torch_prefill"] = speed["mlx"]["prefill_tok_s"] / speed["torch"]["prefill_tok_s"]
    return agreement(te, me, prompts, args, fmt, out, checkpoint)


def agreement(te, oe, prompts: list, args, label: str, out: dict, checkpoint, other: str = "mlx") -> dict:
    """The gate's two measures of engine `oe` against the torch reference engine `te` (module docstring),
    added to `out`; `other` names oe in the per-prompt fields."""
    agree = total = identical = 0
    per_prompt = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        ref = greedy(te, p, args.tokens)
        other_rows = teacher_forced(oe, p, ref)
        got = other_rows.argmax(-1).tolist()
        same = [g == r for g, r in zip(got, ref)]
        agree, total = agree + sum(same), total + len(ref)
        row = {"prompt_tokens": len(p), "positions": len(ref), "agreeing": sum(same)}
        if all(same):
            identical += 1
            row["greedy_identical"] = True
        else:
            j = same.index(False)
            other_greedy = greedy(oe, p, args.tokens)
            first = next((k for k, (a, b) in enumerate(zip(other_greedy, ref)) if a != b), min(len(other_greedy), len(ref)))
            identical += int(other_greedy == ref)
            torch_row, other_row = teacher_forced(te, p, ref[: j + 1])[j], other_rows[j]
            row |= {"greedy_identical": other_greedy == ref, "first_divergence": first, "torch_token": ref[j],
                    f"{other}_token": got[j], "torch_top2_margin": margin(torch_row), f"{other}_top2_margin": margin(other_row),
                    "torch_logit_gap_between_the_two": float(torch_row[ref[j]] - torch_row[got[j]]),
                    f"{other}_logit_gap_between_the_two": float(other_row[got[j]] - other_row[ref[j]])}
        per_prompt.append(row)
        print(f"{label} prompt {i}: {row}", flush=True)
        out |= {"teacher_forced_argmax_agreement": agree / total, "positions": total, "greedy_identical": identical,
                "prompts": len(per_prompt), "prompts_planned": len(prompts), "complete": len(per_prompt) == len(prompts),
                "agreement_seconds": time.perf_counter() - t0, "per_prompt": per_prompt}
        checkpoint(out)
    out["passes_agreement_gate"] = agree / total >= 0.99 and identical >= round(0.9 * len(prompts))
    return out


def run_control(path, prompts: list, args, checkpoint=lambda row: None) -> dict:
    """The int4 control: torch int4 against torch int4 whose RMSNorm divides by sqrt(mean(x^2) + eps)
    instead of multiplying by its rsqrt, an equally valid fp32 RMSNorm that moves ~30 % of its outputs
    by 1-2 ulp (~3e-7 relative), the size of the differences between two frameworks' fp32 kernels.
    Same measures as the MLX comparison: how much of the int4 greedy divergence any second
    implementation that is not bit-identical gets, on the same weights and the same int4 kernel."""
    import types

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy

    def rms_by_division(self, x, w):
        xf = x.float()
        return w * (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_eps)).to(x.dtype)

    tm, pm = TorchCausalLM.load(path, weights="int4"), TorchCausalLM.load(path, weights="int4")
    pm.rms = types.MethodType(rms_by_division, pm)
    probe = torch.randn(64, tm.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    a, b = tm.rms(probe, tm.layers[0].ln_in), pm.rms(probe, pm.layers[0].ln_in)
    out = {"perturbation": "RMSNorm x / sqrt(ms + eps) instead of x * rsqrt(ms + eps) (torch int4 both sides)",
           "perturbed_rms_outputs_unequal_fraction": float((a != b).float().mean()),
           "perturbed_rms_max_relative_diff": float(((a - b).abs() / a.abs().clamp_min(1e-6)).max())}
    te, pe = (Engine(m, KVStrategy("full"), prefill_chunk=256) for m in (tm, pm))
    return agreement(te, pe, prompts, args, "int4-control", out, checkpoint, other="perturbed")


def run_probe(path, prompts: list, formats: list) -> dict:
    """Where the backends part, per format: both run the same prompt (prefill, plain causal attention)
    piece by piece; after the embedding and after each layer, the fraction of the residual stream's
    elements that differ and the largest difference, then the same for the logits."""
    import mlx.core as mx
    import numpy as np

    from inference_engine.backends.mlx.model import MlxCausalLM
    from inference_engine.backends.torch.model import TorchCausalLM

    def host(a):
        return a.detach().float().numpy().copy() if isinstance(a, torch.Tensor) else np.array(a.astype(mx.float32))

    def stream(m, p):
        x = m.embed_ids(m.tensor(p))
        rope = m.rope(torch.arange(len(p)) if m.backend_name == "torch" else m.tensor(list(range(len(p)))))
        out = [host(x)]
        with m.inference():
            for i in range(m.spec.num_layers):
                q, k, v = m.project(i, x)
                q, _ = m.position_q(i, q, rope)
                k = m.position_k(i, k, rope)
                x = m.finish(i, x, m.attend(i, q, k, v, None))
                out.append(host(x))
            out.append(host(m.logits(m.final_norm(x))))
        return out

    res = {"prompt_tokens": [len(p) for p in prompts], "what": "after embedding, after each layer, then logits"}
    for fmt in formats:
        tm, mm = TorchCausalLM.load(path, weights=fmt), MlxCausalLM.load(path, weights=fmt)
        rows = []
        for p in prompts:
            for i, (a, b) in enumerate(zip(stream(tm, p), stream(mm, p))):
                d = np.abs(a - b)
                r = {"unequal_fraction": float((a != b).mean()), "max_abs_diff": float(d.max())}
                if i < len(rows):
                    rows[i] = {k: max(rows[i][k], r[k]) for k in r}
                else:
                    rows.append(r)
        res[fmt] = {"per_point_worst_over_prompts": rows, "logits_max_abs_diff": rows[-1]["max_abs_diff"],
                    "layer0_unequal_fraction": rows[1]["unequal_fraction"]}
    return res


def main(argv=None) -> int:
    import mlx.core as mx
    import mlx_lm
    from transformers import AutoTokenizer

    from inference_engine.model_store import resolve_model

    args = parse_args(argv)
    if args.merge:
        return merge(args)
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    prompts, _ = held_out(AutoTokenizer.from_pretrained(path), args.prompts, 0, 0)
    out = pathlib.Path(args.out)
    meta = run_metadata(vars(args)) | {
        "mlx": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device())},
        "speed_measured_on": "Linux x86 CPU (this machine, shared by other jobs: see load_average_at_start): "
                             "MLX's CPU backend, one thread; "
                             "torch at --threads. "
                             "Apple Silicon: not measured here.",
    }
    if args.probe:
        row = run_probe(path, prompts, args.formats.split(","))
        write_json(out, meta | {"probes": {"layer_by_layer": row}})
        for fmt in args.formats.split(","):
            print(fmt, {k: v for k, v in row[fmt].items() if k != "per_point_worst_over_prompts"})
        return 0
    if args.control:
        row = run_control(path, prompts, args,
                          checkpoint=lambda r: write_json(out, meta | {"controls": {"int4_torch_vs_torch_ulp_rms": r}}))
        write_json(out, meta | {"controls": {"int4_torch_vs_torch_ulp_rms": row}})
        print(f"control: agreement {row['teacher_forced_argmax_agreement']:.4f}, "
              f"greedy identical {row['greedy_identical']}/{row['prompts']}")
        return 0
    rows: dict = {}
    for fmt in args.formats.split(","):
        rows[fmt] = run_format(fmt, path, prompts, args,
                               checkpoint=lambda row, fmt=fmt: write_json(out, meta | {"formats": rows | {fmt: row}}))
    payload = meta | {"formats": rows}
    write_json(out, payload)
    if "parts" not in out.parts:
        _plot(rows, out.with_suffix(".png"))
    for fmt, r in rows.items():
        print(f"{fmt}: agreement {r['teacher_forced_argmax_agreement']:.4f}, greedy identical {r['greedy_identical']}/{r['prompts']}, "
              f"decode mlx/torch {r['mlx_vs_torch_decode']:.2f}x, prefill {r['mlx_vs_torch_prefill']:.2f}x")
    return 0


def merge(args) -> int:
    """One result from parts that each measured some formats (provenance kept per part)."""
    import json

    rows, controls, probes, parts = {}, {}, {}, []
    for part in args.merge:
        doc = json.loads(pathlib.Path(part).read_text())
        rows |= doc.get("formats", {})
        controls |= doc.get("controls", {})
        probes |= doc.get("probes", {})
        parts.append({"part": os.path.relpath(part, ROOT), "formats": list(doc.get("formats", {})),
                      "controls": list(doc.get("controls", {})), "probes": list(doc.get("probes", {})),
                      **{k: doc[k] for k in ("command", "commit", "dirty_worktree", "date_utc", "machine", "mlx")}})
    payload = run_metadata(vars(args)) | {"mlx": parts[0]["mlx"], "speed_measured_on": doc["speed_measured_on"],
                                          "parts": parts, "formats": rows} | ({"controls": controls} if controls else {}) \
        | ({"probes": probes} if probes else {})
    out = pathlib.Path(args.out)
    write_json(out, payload)
    _plot(rows, out.with_suffix(".png"))
    return 0


def _plot(rows: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    x = range(len(fmts))
    for ax, key, label in zip(axes[:2], ("decode_tok_s", "prefill_tok_s"), ("decode tok/s", "prefill tok/s")):
        ax.bar([i - 0.2 for i in x], [rows[f]["speed"]["torch"][key] for f in fmts], 0.4, label="torch", color="#888")
        ax.bar([i + 0.2 for i in x], [rows[f]["speed"]["mlx"][key] for f in fmts], 0.4, label="mlx", color="#47a")
        ax.set_xticks(list(x), fmts)
        ax.set_title(f"{label} (Linux x86 CPU)")
        ax.legend()
    axes[2].bar(fmts, [rows[f]["teacher_forced_argmax_agreement"] for f in fmts], color="#4a7")
    for i, f in enumerate(fmts):
        axes[2].text(i, 0.985, f"greedy {rows[f]['greedy_identical']}/{rows[f]['prompts']}", ha="center")
    axes[2].set_ylim(0.98, 1.0)
    axes[2].axhline(0.99, color="r", lw=1, ls="--")
    axes[2].set_title("torch vs MLX teacher-forced argmax agreement")
    fig.suptitle("MLX backend vs torch backend, same weights; Apple Silicon not measured")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
