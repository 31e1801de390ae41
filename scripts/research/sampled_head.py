"""The LM head of sampled steps (temperature > 0) on the CPU with the native step: torch's int8 kernel (bf16
activations, emulated where the CPU has no bf16) against the native int4 kernel over the head's 4-bit copy plus the
4-bit residual of what that copy leaves (the copy with two int8 activation planes, the residual with one, summed:
~8-bit weights; RefinedHead.kernel, csrc/row_step.cpp refined_head), each with its top `refine` (16) rescored exactly
in fp32; and top-p by a whole sort against top_p_filter (the best 256 first). Side by side in one process:

  1. quality: on the head inputs of --prompts held-out prompts (bench_weights' held-out split, half chat, half code),
     teacher-forced through the int4 model: each arm's logits against the fp32 head's (x @ W^T): max and mean absolute
     error, total variation distance of the softmax at temperature 1 and 0.7, top-1 agreement;
  2. the head call alone, --rows 1 and 8, median of --rounds interleaved rounds;
  3. whole sampled decode steps in-process (Engine, one session, `full`, temperature 0.7, top-p 0.9, a fixed seed),
     --decode tokens after each held-out prompt, per arm, and greedy decoding as the reference, interleaved;
  4. top-p on one row of real logits at temperature 0.7: a sort of the whole vocabulary against top_p_filter; one
     token drawn from the resulting probabilities: torch.multinomial against sampling.draw (inverse CDF).
Writes results/research/sampled_head.json.

    python scripts/research/sampled_head.py --threads 2
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402

ARMS = ("int8", "q4-residual")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts (half chat, half code)")
    p.add_argument("--positions", type=int, default=64, help="positions per prompt whose head input is scored")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--decode", type=int, default=48, help="sampled tokens per prompt and arm (0: skip)")
    p.add_argument("--decode-rounds", type=int, default=2)
    p.add_argument("--random-prompts", action="store_true",
                   help="seeded random token ids instead of the held-out prompts (a model without a tokenizer: tests)")
    p.add_argument("--out", default=str(ROOT / "results" / "research" / "sampled_head.json"))
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from bench_weights import full_logits, held_out
    from inference_engine.backends.torch.linear import RefinedHead
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.generate import Engine
    from inference_engine.engine.requests import GenerateParams, SamplingParams
    from inference_engine.engine.sampling import draw, top_p_filter
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    meta = run_metadata(vars(args))
    path = resolve_model(args.model)
    m = TorchCausalLM.load(path, weights="int4")
    m.use_step_graphs("auto")
    head = m.head
    if m.native_step is None or not isinstance(head, RefinedHead) or head.kernel is None:
        raise SystemExit("sampled_head: the native step's sampled head is not available here (no C++ compiler or no "
                         "AVX2, or a head the int4 kernel cannot pack)")
    kernels = {"int8": None, "q4-residual": head.kernel}

    def use(arm: str) -> None:
        head.kernel = kernels[arm]

    if args.random_prompts:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, m.spec.vocab_size, (args.positions,), generator=g).tolist() for _ in range(args.prompts)]
    else:
        prompts, _ = held_out(AutoTokenizer.from_pretrained(path), args.prompts, 0, 0)
    inputs = []  # the head's inputs: teacher-forced through the int4 model, caught at the head
    head_type = type(head)
    real_call = head_type.__call__

    def catching(self, x, greedy=False):
        inputs.append(x.detach().float().clone())
        return real_call(self, x, greedy=greedy)

    head_type.__call__ = catching
    try:
        for ids in prompts:
            full_logits(m, ids[: args.positions])
    finally:
        head_type.__call__ = real_call
    x = torch.cat(inputs)
    exact = x @ head.w.T

    def tv(a, b, t):
        return 0.5 * (torch.softmax(a / t, -1) - torch.softmax(b / t, -1)).abs().sum(-1)

    quality = {}
    for arm in ARMS:
        use(arm)
        y = torch.cat([head(x[i:i + 64]) for i in range(0, x.shape[0], 64)])
        err = (y - exact).abs()
        quality[arm] = {"positions": int(x.shape[0]), "max_abs_error": round(float(err.max()), 5),
                        "mean_abs_error": round(float(err.mean()), 6),
                        "tv_t1_mean": round(float(tv(y, exact, 1.0).mean()), 6), "tv_t1_max": round(float(tv(y, exact, 1.0).max()), 6),
                        "tv_t07_mean": round(float(tv(y, exact, 0.7).mean()), 6),
                        "top1_agreement": round(float((y.argmax(-1) == exact.argmax(-1)).float().mean()), 5)}
        print(arm, quality[arm], flush=True)

    rows = [int(r) for r in args.rows.split(",")]
    times: dict = {(a, r): [] for a in ARMS for r in rows}
    for _ in range(args.rounds):
        for a in ARMS:
            use(a)
            for r in rows:
                xr = x[:r].contiguous()
                t = time.perf_counter()
                head(xr)
                times[a, r].append(time.perf_counter() - t)
    head_ms = {a: {str(r): round(1000 * statistics.median(times[a, r]), 3) for r in rows} for a in ARMS}
    print("head ms", head_ms, flush=True)

    decode: dict = {}
    if args.decode:
        engine = Engine(m, KVStrategy("full"), prefill_chunk=256)
        sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
        cells = [*ARMS, "greedy"]
        spent: dict = {c: [0.0, 0] for c in cells}
        for _ in range(args.decode_rounds):
            for ids in prompts:
                for c in cells:
                    use("q4-residual" if c == "greedy" else c)
                    kv = engine.new_session_kv()
                    params = GenerateParams(max_tokens=args.decode, sampling=SamplingParams() if c == "greedy" else sampled)
                    first = None
                    for ev in engine.generate(kv, ids, params):
                        if isinstance(ev, TokenGenerated):
                            if first is None:
                                first, n = time.perf_counter(), 0
                            else:
                                n += 1
                    if first is not None and n:
                        spent[c][0] += time.perf_counter() - first
                        spent[c][1] += n
        rate = {c: spent[c][1] / spent[c][0] for c in cells if spent[c][0] > 0}
        decode = {c: {"tok_s": round(rate[c], 1), "vs_greedy": round(rate[c] / rate["greedy"], 3)} for c in rate}
        decode["sampling"] = {"temperature": 0.7, "top_p": 0.9, "tokens_per_prompt": args.decode}
        print("decode", decode, flush=True)
    use("q4-residual")

    logits = (exact[-1:] - exact[-1:].amax(-1, keepdim=True)) / 0.7

    def sort_all(z, top_p=0.9):  # the definition, by sorting the whole vocabulary (what sampling did before)
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        pr = torch.softmax(sorted_z, -1)
        return z.scatter(-1, idx, sorted_z.masked_fill((torch.cumsum(pr, -1) - pr) >= top_p, float("-inf")))

    tp: dict = {"sort": [], "top_p_filter": []}
    for _ in range(args.rounds):
        for name, fn in (("sort", sort_all), ("top_p_filter", lambda z: top_p_filter(z, 0.9))):
            t = time.perf_counter()
            fn(logits)
            tp[name].append(time.perf_counter() - t)
    probs = torch.softmax(top_p_filter(logits, 0.9), -1)[0]
    gen = torch.Generator().manual_seed(0)
    tp |= {"multinomial": [], "draw": []}
    for _ in range(args.rounds):
        for name, fn in (("multinomial", lambda: torch.multinomial(probs, 1, generator=gen)), ("draw", lambda: draw(probs, gen))):
            t = time.perf_counter()
            fn()
            tp[name].append(time.perf_counter() - t)
    top_p_ms = {k: round(1000 * statistics.median(v), 3) for k, v in tp.items()}
    kept_same = bool(torch.equal(torch.isfinite(sort_all(logits)), torch.isfinite(top_p_filter(logits, 0.9))))
    print("top-p and draw ms", top_p_ms, "same kept set", kept_same, flush=True)

    doc = meta | {"step": m.describe_step(), "quality": quality, "head_ms": head_ms, "decode": decode,
                  "top_p_ms": top_p_ms, "top_p_same_kept_set": kept_same,
                  "what": "the sampled steps' LM head: torch's int8 kernel (bf16 activations) vs the native int4 kernel over "
                          "the head's 4-bit copy (two activation planes) and its 4-bit residual (one), each with the top 16 "
                          "rescored in fp32; quality against the fp32 head on teacher-forced held-out positions, head "
                          "call time, whole sampled decode steps (temperature 0.7, top-p 0.9) against greedy; top-p by a "
                          "whole sort vs top_p_filter, one draw by torch.multinomial vs sampling.draw"}
    write_json(pathlib.Path(args.out), doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
