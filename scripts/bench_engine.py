"""This daemon against llama.cpp and transformers on the same model, side by side in one run.

Arms (same machine, same thread count, greedy unless --temperature samples every generated token in every arm the
same way: temperature, top-p, no top-k, no min-p; eos ignored):
  kakeya-<fmt>   `kakeya serve --kv-strategy full --weights <fmt> --persist off --compile off` in its own
                 process, driven only through the Python SDK over gRPC (one arm per entry of --formats;
                 `int4+kv_int8` adds `--kv-dtype int8`, `int4+kv_fp16` `--kv-dtype fp16`, `int4+kv_fp32`
                 `--kv-dtype fp32`; without one the daemon's default, `--kv-dtype auto`)
  kakeya-<fmt>-auto  the same with `--compile auto` (the default): on the CPU the native row step
                 (backends/torch/native.py: decode rows and verify blocks through every layer in one C++
                 call); like -compile its daemon starts twice, first with an empty build cache
                 ($KAKEYA_NATIVE_DIR: it builds the extension), then warm (measured)
  kakeya-<fmt>-compile  the same with `--compile on` (inductor's segments on the CPU, CUDA graphs on a GPU);
                 its daemon starts twice: once with an empty compile cache (cold), then with the cache the
                 first start filled (warm, the one measured). Each arm records its seconds to READY.
  llama.cpp      llama-cpp-python on the very GGUF the model store pulled (`source.gguf`);
                 install the `bench` extra: the wheel is cached under $KAKEYA_HOME/wheels
  transformers   `transformers.generate` on the pulled fp32 directory (decode at short contexts only)

Measured: decode tok/s after --contexts tokens of context; prefill tok/s of a --prefill prompt;
a --turns-turn session (--append appended + --generate generated per turn): latency of the
last turn (llama.cpp reuses the longest common prefix of its previous evaluation). Ratios
daemon / llama.cpp are taken from this one run.

    .venv/bin/python scripts/bench_engine.py --threads 2      # -> results/bench_engine.json + .png
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import run_metadata, write_json  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--formats", default="fp32,int8,int4,int4+kv_int8",
                    help="weight formats; +kv_int8 / +kv_fp16 = with --kv-dtype int8 / fp16")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--decode", type=int, default=32, help="tokens generated per decode measurement")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--append", type=int, default=200)
    ap.add_argument("--generate", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", default="off,auto,on", help="--compile modes of the daemon, one arm per format and mode")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample every generated token at this temperature (0: greedy), in this daemon and llama.cpp alike")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling (1: off); no top-k, no "
                    "min-p on either side")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_engine.json"))
    return ap.parse_args(argv)


def tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


# -- this daemon ------------------------------------------------------------------------------
class Daemon:
    def __init__(self, model: str, weights: str, threads: int, kv_dtype: str = "auto", compile: str = "off",
                 compile_cache: str | None = None):
        cmd = [str(ROOT / ".venv" / "bin" / "kakeya"), "serve", "--bind", "127.0.0.1:0", "--model", model,
               "--kv-strategy", "full", "--weights", weights, "--kv-dtype", kv_dtype, "--threads", str(threads),
               "--capacity", "64", "--persist", "off", "--compile", compile]
        env = dict(os.environ) | ({"TORCHINDUCTOR_CACHE_DIR": compile_cache, "KAKEYA_NATIVE_DIR": compile_cache}
                                  if compile_cache else {})
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self.proc.stdout.readline()
        self.ready_s = time.perf_counter() - t0
        if not line.startswith("READY"):
            self.proc.kill()
            raise RuntimeError(f"kakeya serve did not start: {line!r}")
        import kakeya

        self.client = kakeya.Client(f"127.0.0.1:{line.split()[1]}")

    def close(self):
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)


def sampling(args) -> dict:
    """The SDK's Generate arguments for --temperature / --top-p (greedy by default)."""
    return {"temperature": args.temperature, "top_p": args.top_p, "seed": 1} if args.temperature > 0 else {}


def llama_sampling(args) -> dict:
    """llama-cpp-python's sample()/generate() arguments for the same: its default chain also has top-k 40 and min-p
    0.05, turned off so both sides draw from the same distribution."""
    return {"temp": args.temperature, "top_p": args.top_p, "top_k": 0, "min_p": 0.0} if args.temperature > 0 else {"temp": 0.0}


def hf_sampling(args) -> dict:
    """transformers' generate() arguments for the same (its default top-k 50 turned off)."""
    if args.temperature > 0:
        return {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": 0}
    return {"do_sample": False}


def kakeya_arm(d: Daemon, args) -> dict:
    out = {"decode_tok_s": {}, "prefill_tok_s": None, "turn_latency_s": []}
    for ctx in map(int, args.contexts.split(",")):
        with d.client.create_session(tokens(ctx, ctx), ignore_eos=True) as s:
            s.generate_all(max_tokens=1)  # prefill
            r = s.generate_all(max_tokens=args.decode, **sampling(args))
            out["decode_tok_s"][ctx] = (r.generated_tokens - 1) / (r.total_seconds - r.time_to_first_token_seconds)
    with d.client.create_session(tokens(args.prefill, 7), ignore_eos=True) as s:
        r = s.generate_all(max_tokens=1)
        out["prefill_tok_s"] = r.prefill_tokens / r.prefill_seconds
    with d.client.create_session(ignore_eos=True) as s:
        for t in range(args.turns):
            start = time.perf_counter()
            s.append(tokens(args.append, 100 + t))
            s.generate_all(max_tokens=args.generate, **sampling(args))
            out["turn_latency_s"].append(time.perf_counter() - start)
    return out


# -- llama.cpp ----------------------------------------------------------------------------------
def llama_cpp_arm(gguf: pathlib.Path, args) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=8192, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    out = {"decode_tok_s": {}, "prefill_tok_s": None, "turn_latency_s": []}

    def decode(prompt):
        llm.reset()
        llm.eval(prompt)
        tok = llm.sample(**llama_sampling(args))
        start = time.perf_counter()
        for _ in range(args.decode - 1):
            llm.eval([tok])
            tok = llm.sample(**llama_sampling(args))
        return (args.decode - 1) / (time.perf_counter() - start)

    for ctx in map(int, args.contexts.split(",")):
        out["decode_tok_s"][ctx] = decode(tokens(ctx, ctx))
    llm.reset()
    start = time.perf_counter()
    llm.eval(tokens(args.prefill, 7))
    out["prefill_tok_s"] = args.prefill / (time.perf_counter() - start)
    llm.reset()
    history: list[int] = []
    for t in range(args.turns):
        start = time.perf_counter()
        history += tokens(args.append, 100 + t)
        gen = llm.generate(history, **llama_sampling(args))  # reset=True: keeps the longest common prefix of the last evaluation
        for _ in range(args.generate):
            history.append(next(gen))
        out["turn_latency_s"].append(time.perf_counter() - start)
    return out


# -- transformers ------------------------------------------------------------------------------
def transformers_arm(path: pathlib.Path, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {"decode_tok_s": {}}
    for ctx in [c for c in map(int, args.contexts.split(",")) if c <= 1024]:
        ids = torch.tensor([tokens(ctx, ctx)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=args.decode, min_new_tokens=args.decode, **hf_sampling(args))
            total = time.perf_counter() - t0
        out["decode_tok_s"][ctx] = (args.decode - 1) / max(1e-9, total - first)
    return out


def main(argv=None) -> int:
    from inference_engine.model_store import resolve_model

    args = parse_args(argv)
    path = pathlib.Path(resolve_model(args.model))
    arms = {}
    for fmt in args.formats.split(","):
        weights, _, kv_dtype = fmt.partition("+kv_")  # e.g. int4+kv_int8: int4 weights, int8 resident K/V
        for mode in args.compile.split(","):
            name, start = f"kakeya-{fmt}" + {"off": "", "auto": "-auto", "on": "-compile"}[mode], {}
            cache = None
            if mode in ("on", "auto"):  # cold: an empty compile cache (inductor's, or the native step's build)
                import tempfile

                cache = tempfile.mkdtemp(prefix=f"kakeya-bench-{mode}-")
                cold = Daemon(args.model, weights, args.threads, kv_dtype or "auto", mode, cache)
                start["ready_cold_s"] = round(cold.ready_s, 2)
                cold.close()
            d = Daemon(args.model, weights, args.threads, kv_dtype or "auto", mode, cache)
            start["ready_s" if mode == "off" else "ready_warm_s"] = round(d.ready_s, 2)
            try:
                arms[name] = {"compile": mode, **start, **kakeya_arm(d, args)}
            finally:
                d.close()
            print(name, start, arms[name]["decode_tok_s"], flush=True)
    if not args.skip_llama_cpp:
        gguf = path / "source.gguf"
        if not gguf.exists():
            raise SystemExit(f"{gguf} is missing: re-pull the model (`kakeya models pull {args.model} --force`)")
        arms["llama.cpp"] = llama_cpp_arm(gguf, args)
        print("llama.cpp", arms["llama.cpp"]["decode_tok_s"], flush=True)
    if not args.skip_transformers:
        arms["transformers"] = transformers_arm(path, args)
    ratios = {}
    if "llama.cpp" in arms:
        ref = arms["llama.cpp"]
        for name, a in arms.items():
            if not name.startswith("kakeya-"):
                continue
            ratios[name] = {
                "decode_vs_llama_cpp": {c: a["decode_tok_s"][c] / ref["decode_tok_s"][c] for c in a["decode_tok_s"]},
                "prefill_vs_llama_cpp": a["prefill_tok_s"] / ref["prefill_tok_s"],
                "last_turn_latency_vs_llama_cpp": a["turn_latency_s"][-1] / ref["turn_latency_s"][-1],
            }
    best = max((n for n in arms if n.startswith("kakeya-")), key=lambda n: arms[n]["decode_tok_s"][min(arms[n]["decode_tok_s"])])
    targets = None
    if best in ratios:  # issue 28's gates, on the arm that decodes fastest at the shortest context
        r = ratios[best]
        targets = {"arm": best,
                   "decode_ge_1x_at_every_context": all(v >= 1.0 for v in r["decode_vs_llama_cpp"].values()),
                   "prefill_ge_1_5x": r["prefill_vs_llama_cpp"] >= 1.5,
                   "last_turn_latency_le_0_8x": r["last_turn_latency_vs_llama_cpp"] <= 0.8,
                   "warm_ready_le_30s": all(a.get("ready_warm_s", a.get("ready_s", 0)) <= 30 for n, a in arms.items()
                                            if n.startswith("kakeya-"))}
    payload = run_metadata(vars(args)) | {"arms": arms, "ratios": ratios, "targets": targets}
    out = pathlib.Path(args.out)
    write_json(out, payload)
    _plot(arms, out.with_suffix(".png"), args)
    return 0


def _plot(arms: dict, path: pathlib.Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    for name, arm in arms.items():
        ctx = sorted(arm["decode_tok_s"])
        a.plot(ctx, [arm["decode_tok_s"][k] for k in ctx], marker="o", label=name)
        if arm.get("turn_latency_s"):
            c.plot(range(1, len(arm["turn_latency_s"]) + 1), arm["turn_latency_s"], marker=".", label=name)
    a.set(xscale="log", xlabel="context tokens", ylabel="decode tok/s", title="decode")
    names = [n for n in arms if arms[n].get("prefill_tok_s")]
    b.bar(names, [arms[n]["prefill_tok_s"] for n in names])
    b.set(title=f"prefill of {args.prefill} tokens (tok/s)")
    b.tick_params(axis="x", rotation=30)
    c.set(xlabel="turn", ylabel="seconds", title=f"turn latency (+{args.append} / {args.generate} generated)")
    a.legend(fontsize=8)
    c.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, {args.threads} threads, one run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
