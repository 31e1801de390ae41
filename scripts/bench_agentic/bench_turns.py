"""20-turn agent conversation, three ways, side by side in one run.

(a) session path: one Kakeya session; each turn appends the new ~200 tokens and generates
    32 (through the real gRPC server and the Python SDK), for `sink_window` and `full`;
(b) re-prefill path: what a stateless server does - a new session with the whole history
    every turn (same server, same engine);
(c) transformers `generate` on the same weights with the whole history every turn.

Per turn: time to first token and total latency; per path: decode tokens/s. Ratios:
session turn-20 / turn-1 latency (target <= 1.5) and session decode tok/s over
transformers decode tok/s (target >= 5). Writes results/bench_turns.json and .png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, run_metadata, write_json  # noqa: E402


def user_turns(tokenizer, n_turns: int, tokens_per_turn: int) -> list[list[int]]:
    """~tokens_per_turn-token user messages cut from Python stdlib sources on this machine."""
    import inspect
    import json as json_mod

    text = inspect.getsource(json_mod.decoder) + inspect.getsource(json_mod.encoder) + inspect.getsource(argparse)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    head = tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    tail = tokenizer("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    body = tokens_per_turn - len(head) - len(tail)
    return [head + ids[i * body : (i + 1) * body] + tail for i in range(n_turns)]


class TimingStreamer:
    """transformers streamer that timestamps the first generated token."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # first call carries the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


def decode_rate(n: int, ttft: float, total: float) -> float:
    return (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--append", type=int, default=200)
    ap.add_argument("--generate", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_turns.json"))
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kakeya
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.generate import Engine
    from inference_engine.kv.strategy import KVStrategy
    from inference_engine.model_store import resolve_model
    from inference_engine.server.app import ServeConfig, start
    from inference_engine.server.runtime import Runtime

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    turns = user_turns(tok, args.turns, args.append)
    model = TorchCausalLM.load(path)
    servers = {}
    for name in ("sink_window", "full"):
        rt = Runtime(Engine(model, KVStrategy(name)), capacity=4)
        servers[name] = start(ServeConfig(bind="127.0.0.1:0"), rt)
    hf = None if args.skip_transformers else AutoModelForCausalLM.from_pretrained(path).eval()

    def sdk_turn(session, ids):
        t0 = time.perf_counter()
        session.append(ids)
        first, n = None, 0
        for _ in session.generate(max_tokens=args.generate):
            n += 1
            first = first or time.perf_counter()
        t1 = time.perf_counter()
        return session.last_result.tokens, first - t0, t1 - t0

    clients = {k: kakeya.Client(f"127.0.0.1:{s.port}") for k, s in servers.items()}
    sessions = {k: c.create_session(ignore_eos=True) for k, c in clients.items()}
    rows, history = [], []
    for i, user in enumerate(turns):
        history += user
        row = {"turn": i + 1, "history_tokens_before_generate": len(history)}
        gen_tokens = None
        for name in ("sink_window", "full"):
            toks, ttft, total = sdk_turn(sessions[name], user)
            row[f"session_{name}"] = {"ttft_s": ttft, "total_s": total, "decode_tok_s": decode_rate(len(toks), ttft, total)}
            if name == "full":
                gen_tokens = list(toks)
        # (b) stateless re-prefill: new session with the whole history (same server, `full`)
        fresh = clients["full"].create_session(ignore_eos=True)
        toks, ttft, total = sdk_turn(fresh, history)
        fresh.close()
        row["reprefill_full"] = {"ttft_s": ttft, "total_s": total, "decode_tok_s": decode_rate(len(toks), ttft, total)}
        row["reprefill_matches_session_full"] = list(toks) == gen_tokens
        if hf is not None:
            streamer = TimingStreamer()
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(torch.tensor([history]), max_new_tokens=args.generate, min_new_tokens=args.generate,
                                  do_sample=False, pad_token_id=tok.pad_token_id or 0, streamer=streamer)
            total = time.perf_counter() - t0
            ttft = streamer.first - t0
            n = out.shape[1] - len(history)
            row["transformers_generate"] = {"ttft_s": ttft, "total_s": total, "decode_tok_s": decode_rate(n, ttft, total)}
            row["transformers_matches_session_full"] = out[0, len(history):].tolist() == gen_tokens
        history += gen_tokens  # the conversation continues with the assistant's reply
        rows.append(row)
        print(f"turn {i + 1:2d} hist {row['history_tokens_before_generate']:5d}  "
              + "  ".join(f"{k} {row[k]['total_s']:.2f}s" for k in row if isinstance(row[k], dict)), flush=True)

    for s in sessions.values():
        s.close()
    for s in servers.values():
        s.stop()

    def med(key, field, sl=slice(None)):
        return statistics.median(r[key][field] for r in rows[sl])

    paths = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    summary = {
        p: {
            "turn1_total_s": rows[0][p]["total_s"],
            "turn_last_total_s": rows[-1][p]["total_s"],
            "last_over_first_latency": rows[-1][p]["total_s"] / rows[0][p]["total_s"],
            "median_decode_tok_s": med(p, "decode_tok_s"),
            "median_ttft_s": med(p, "ttft_s"),
        }
        for p in paths
    }
    ratios = {
        "session_sink_window_last_over_first_latency": summary["session_sink_window"]["last_over_first_latency"],
        "session_full_last_over_first_latency": summary["session_full"]["last_over_first_latency"],
        "reprefill_last_over_first_latency": summary["reprefill_full"]["last_over_first_latency"],
        "reprefill_over_session_sink_window_turn_last": rows[-1]["reprefill_full"]["total_s"] / rows[-1]["session_sink_window"]["total_s"],
    }
    if hf is not None:
        hf_decode = summary["transformers_generate"]["median_decode_tok_s"]
        ratios["session_sink_window_decode_over_transformers"] = summary["session_sink_window"]["median_decode_tok_s"] / hf_decode
        ratios["session_full_decode_over_transformers"] = summary["session_full"]["median_decode_tok_s"] / hf_decode
        last = rows[-1]
        ratios["transformers_over_session_sink_window_turn_last"] = (last["transformers_generate"]["total_s"]
                                                                   / last["session_sink_window"]["total_s"])
    targets = {
        "session_last_over_first_latency_max": 1.5,
        "decode_over_transformers_min": 5.0,
        "met_latency": ratios["session_sink_window_last_over_first_latency"] <= 1.5,
        "met_decode": ratios.get("session_sink_window_decode_over_transformers", 0) >= 5.0,
    }
    cfg = vars(args) | {"model_path": str(path), "kv_session_default": "sink_window 4+1020"}
    out = run_metadata(cfg) | {"summary": summary, "ratios": ratios, "targets": targets, "turns": rows}
    import pathlib

    out_path = pathlib.Path(args.out)
    write_json(out_path, out)
    plot(rows, paths, out_path.with_suffix(".png"))
    print(ratios)
    return 0


def plot(rows, paths, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["turn"] for r in rows]
    for p in paths:
        axes[0].plot(x, [r[p]["total_s"] for r in rows], marker="o", ms=3, label=p)
        axes[1].plot(x, [r[p]["ttft_s"] for r in rows], marker="o", ms=3, label=p)
    axes[0].set(title="turn latency (append ~200, generate 32)", xlabel="turn", ylabel="seconds")
    axes[1].set(title="time to first token", xlabel="turn", ylabel="seconds")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
