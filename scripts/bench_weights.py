"""Weight formats of the torch backend, side by side in one run: fidelity, quality, speed.

For each of fp32 / int8 / int4 (backends/torch/linear.py) on the pulled model:
  - weights: max |W_format - W_fp32| over the linear layers and the head (int4 built from the
    GGUF's own Q4_1 blocks when the model directory keeps `source.gguf`; also the blocks
    themselves against the pulled fp32 tensors);
  - quality: teacher-forced top-1 agreement with fp32 over held-out prompts (fp32's greedy
    continuation of each, `--tokens` positions; 1/2 chat, 1/2 code, from
    kv_cache_proposer/training/corpus.py's held-out split) and perplexity on held-out Python
    source (stdlib functions in the held-out split); gate: agreement >= 99 % and perplexity
    within 1 % of fp32;
  - speed: decode ms/token (greedy, through Engine.generate, `full` cache, after a short prompt),
    prefill tok/s of a `--prefill` token prompt in 256-token chunks, weight bytes read per token.

    .venv/bin/python scripts/bench_weights.py --threads 2    # -> results/bench_weights.json + .png
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_common import run_metadata, write_json  # noqa: E402

FORMATS = ("fp32", "int8", "int4")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=50, help="held-out prompts for the agreement check (half chat, half code)")
    ap.add_argument("--tokens", type=int, default=64, help="teacher-forced positions per prompt")
    ap.add_argument("--ppl-docs", type=int, default=20, help="held-out Python sources for perplexity")
    ap.add_argument("--ppl-tokens", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_weights.json"))
    return ap.parse_args(argv)


def held_out(tokenizer, n_prompts: int, n_docs: int, ppl_tokens: int):
    from kv_cache_proposer.training import corpus as corpus_mod
    from kakeya.tokenization import tokens_for_chat

    c = corpus_mod.build_corpus()
    _, chat = corpus_mod.split(c.chat)
    _, code = corpus_mod.split(c.code)
    _, text = corpus_mod.split(c.code_text)
    prompts = [tokens_for_chat([{"role": "user", "content": p.text}], tokenizer) for p in chat[: n_prompts // 2]]
    prompts += [tokenizer.encode(p.text) for p in code[: n_prompts - len(prompts)]]
    docs = [ids for ids in (tokenizer.encode(p.text)[:ppl_tokens] for p in text) if len(ids) >= 64][:n_docs]
    return prompts, docs


def fp32_references(path, n_prompts: int, tokens: int) -> list[tuple[list[int], list[int], list[int]]]:
    """The held-out prompts with fp32's greedy continuation (`tokens` long) and fp32's teacher-forced argmax at each
    of its positions: [(prompt, continuation, want)], what top-1 agreement with fp32 is measured against."""
    from transformers import AutoTokenizer

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.requests import GenerateParams
    from inference_engine.kv.strategy import KVStrategy

    prompts, _ = held_out(AutoTokenizer.from_pretrained(path), n_prompts, 0, 0)
    ref = TorchCausalLM.load(path, weights="fp32")
    engine = Engine(ref, KVStrategy("full"), prefill_chunk=256)
    seqs = []
    for p in prompts:
        cont = [e.token_id for e in engine.generate(engine.new_session_kv(), p, GenerateParams(max_tokens=tokens))
                if isinstance(e, TokenGenerated)]
        want = full_logits(ref, p + cont)[len(p) - 1: len(p) - 1 + len(cont)].argmax(-1).tolist()
        seqs.append((p, cont, want))
    return seqs


def full_logits(model, ids: list[int]) -> torch.Tensor:
    from inference_engine.engine.steps import forward
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    cache = make_cache(KVStrategy("full"), model.geometry(), max_step=4096, max_context=model.spec.max_context)
    logits, _ = forward(model, torch.tensor(ids), range(len(ids)), cache)
    return logits.float()


def weight_diffs(model, ref) -> dict:
    worst = 0.0
    for L, R in zip(model.layers, ref.layers):
        for a, b in ((L.wqkv, R.wqkv), (L.wo, R.wo), (L.w_gate_up, R.w_gate_up), (L.w_down, R.w_down)):
            worst = max(worst, float((a.dequantized() - b.dequantized()).abs().max()))
    head = float((model.head.dequantized() - ref.head.dequantized()).abs().max())
    return {"linear_max_abs_diff": worst, "head_max_abs_diff": head}


def decode_and_prefill(model, args) -> dict:
    from inference_engine.engine.events import GenerationDone, TokenGenerated
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.requests import GenerateParams
    from inference_engine.kv.strategy import KVStrategy

    engine = Engine(model, KVStrategy("full"), prefill_chunk=256)
    g = torch.Generator().manual_seed(0)
    long = torch.randint(100, 40000, (args.prefill,), generator=g).tolist()
    kv = engine.new_session_kv()
    t = time.perf_counter()
    engine.prefill(kv, long)
    prefill_s = time.perf_counter() - t
    prompt = long[:128]
    per_token = []
    for _ in range(2):
        kv = engine.new_session_kv()
        evs = list(engine.generate(kv, prompt, GenerateParams(max_tokens=args.decode)))
        done = next(e for e in evs if isinstance(e, GenerationDone))
        n = sum(isinstance(e, TokenGenerated) for e in evs)
        per_token.append((done.total_seconds - done.time_to_first_token_seconds) / max(1, n - 1))
    ms = 1000 * min(per_token)
    return {"prefill_tokens": args.prefill, "prefill_tok_s": args.prefill / prefill_s, "decode_ms_per_token": ms,
            "decode_tok_s": 1000 / ms, "weight_bytes_per_token": model.weight_bytes}


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.model_store import resolve_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    prompts, docs = held_out(tok, args.prompts, args.ppl_docs, args.ppl_tokens)
    models = {f: TorchCausalLM.load(path, weights=f) for f in FORMATS}
    ref = models["fp32"]
    # fp32's greedy continuation of each prompt: the teacher-forced sequences every format scores.
    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.requests import GenerateParams
    from inference_engine.kv.strategy import KVStrategy

    ref_engine = Engine(ref, KVStrategy("full"), prefill_chunk=256)
    sequences = []
    for p in prompts:
        cont = [e.token_id for e in ref_engine.generate(ref_engine.new_session_kv(), p, GenerateParams(max_tokens=args.tokens))
                if isinstance(e, TokenGenerated)]
        sequences.append((p, cont))
    ref_top = [full_logits(ref, p + c)[len(p) - 1 : len(p) - 1 + len(c)].argmax(-1) for p, c in sequences]
    ref_nll = None
    rows = {}
    for fmt, model in models.items():
        agree = total = 0
        for (p, c), want in zip(sequences, ref_top):
            got = full_logits(model, p + c)[len(p) - 1 : len(p) - 1 + len(c)].argmax(-1)
            agree += int((got == want).sum())
            total += len(c)
        nll = []
        for ids in docs:
            lg = full_logits(model, ids)[:-1]
            nll.append(float(torch.nn.functional.cross_entropy(lg, torch.tensor(ids[1:]), reduction="mean")))
        ppl = float(torch.tensor(statistics.fmean(nll)).exp())
        ref_nll = ppl if fmt == "fp32" else ref_nll
        row = {"top1_agreement_with_fp32": agree / total, "positions": total, "perplexity": ppl,
               "perplexity_vs_fp32": ppl / ref_nll - 1.0}
        row["passes_quality_gate"] = row["top1_agreement_with_fp32"] >= 0.99 and abs(row["perplexity_vs_fp32"]) <= 0.01
        row |= weight_diffs(model, ref)
        row |= decode_and_prefill(model, args)
        rows[fmt] = row
        print(fmt, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    blocks_diff = None
    if (pathlib.Path(path) / "source.gguf").exists():
        from inference_engine.model_store.gguf_blocks import q4_1_blocks
        from safetensors import safe_open

        f = safe_open(str(pathlib.Path(path) / "model.safetensors"), "pt")
        blocks_diff = 0.0
        for name, (q, d, m) in q4_1_blocks(pathlib.Path(path) / "source.gguf", num_heads=ref.spec.num_heads,
                                           num_kv_heads=ref.spec.num_kv_heads).items():
            n, k = q.shape
            deq = (q.float().view(n, k // 32, 32) * d[..., None] + m[..., None]).view(n, k)
            blocks_diff = max(blocks_diff, float((deq - f.get_tensor(name)).abs().max()))
    passing = [f for f in FORMATS if rows[f]["passes_quality_gate"]]
    fastest = min(passing, key=lambda f: rows[f]["decode_ms_per_token"]) if passing else "fp32"
    payload = run_metadata(vars(args)) | {
        "formats": rows,
        "gguf_q4_1_blocks_vs_pulled_fp32_max_abs_diff": blocks_diff,
        "int4_built_from": "gguf Q4_1 blocks" if blocks_diff is not None else "fp32 weights (no source.gguf kept)",
        "fastest_passing_format": fastest,
        "decode_speedup_vs_fp32": {f: rows["fp32"]["decode_ms_per_token"] / rows[f]["decode_ms_per_token"] for f in FORMATS},
        "prefill_speedup_vs_fp32": {f: rows[f]["prefill_tok_s"] / rows["fp32"]["prefill_tok_s"] for f in FORMATS},
    }
    out = pathlib.Path(args.out)
    write_json(out, payload)
    _plot(rows, out.with_suffix(".png"))
    print("fastest format passing the quality gate:", fastest)
    return 0


def _plot(rows: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    fmts = list(rows)
    for ax, key, label in zip(axes, ("decode_tok_s", "prefill_tok_s", "top1_agreement_with_fp32"),
                              ("decode tok/s", "prefill tok/s", "top-1 agreement with fp32")):
        ax.bar(fmts, [rows[f][key] for f in fmts], color=["#888", "#4a7", "#47a"])
        ax.set_title(label)
    axes[2].set_ylim(0.9, 1.0)
    axes[2].axhline(0.99, color="r", lw=1, ls="--")
    fig.suptitle("SmolLM2-135M weight formats (torch CPU, one run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
