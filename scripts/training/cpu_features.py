#!/usr/bin/env python
"""The v2 drafter's data stage on the CPU, from the weights that serve: the daemon's own engine
(TorchCausalLM, int4 by default, steps.forward_batch with StepInput.capture) teacher-forced over a
local text and code corpus, written as the chunks kv_cache_proposer/training/dflash_data.py defines, so
`train_drafter_v2.py --stage train --work-dir <out>` trains on them unchanged.

Corpus: kv_cache_proposer/training/gpu_corpus.py's items (the Python stdlib, the installed packages'
sources and docs, man-page NAME lines, the repo's shipped chat prompts; its held-out rule), each item
tokenized as gpu_corpus.PromptTokenizer does (chat template for chat / edit items, raw prefix for code)
and cut to its last --seq-len tokens. One item is one sequence, teacher-forced alone from position 0.

Per chunk (part-NNN.safetensors, dflash_data.CHUNK = 32 sequences, so the trainer's chunk count holds):
tokens (N,) i32, feats (N, L*H) f16 (the engine's StepInput.capture: the residual stream after each
captured layer, concatenated in layer order), final (N, H) f16 (the engine's final normed hidden), argmax
(N,) i32 (the engine's greedy token at each position), seq_offsets (S+1,) i64, gen_start (S,) i64
(= the sequence's length: nothing generated; with --generate the prompt's), style (S,) i64 (dflash_data.STYLES).

The difference from dflash_data's own stage: there the sequences are a prompt plus the verifier's greedy
continuation (targets agree with argmax on the whole continuation); here every token is corpus text, so
the trainer (AnchorSampler) supervises only the blocks where the text agrees with the verifier's argmax.

--generate N makes the other kind of data the issue asks to weigh against teacher forcing: each item's prompt
(its last seq-len - N tokens), then the engine's own greedy continuation (up to N tokens or an eos), every token fed
as a decode row (the rows of --gen-batch sequences in one forward, as the daemon batches sessions), features captured
as it goes; gen_start marks where the continuation starts. Every run reports supervised draft slots (what the
trainer can learn from: AnchorSampler's agreement runs, up to 4 a position) per second beside tokens per second.

The output directory is resumable: jobs.json fixes the plan (every sequence's ids) at the first run; a
chunk is written atomically and skipped when present. --max-tokens caps the plan, --minutes a run.
progress.json accumulates every run's tokens, seconds and bytes; --rate-json writes the measured rate.

    python scripts/training/cpu_features.py --out /tmp/feats --minutes 2 --threads 2 \
        --rate-json results/research/cpu_features_rate.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

T0 = time.monotonic()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_common import run_metadata, write_json  # noqa: E402
from kv_cache_proposer.training import dflash_data, gpu_corpus  # noqa: E402

TOKENS_4M = 4_000_000
STYLE_NOTE = {"chat": "chat-templated user messages (shipped prompts, docstring questions, man-page NAME lines, "
                      "doc paragraphs to summarise)",
              "code": "raw Python prefixes of functions (stdlib and packages)",
              "edit": "chat-templated edit requests over a function's first 200 tokens",
              "synthetic": "not used"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="pulled model name or HF directory (resolve_model)")
    ap.add_argument("--weights", default="int4", choices=["int4", "int8", "fp32"], help="the engine's weight format")
    ap.add_argument("--drafter", default="smollm2-135m-dflash", help="v2 checkpoint whose capture layers to keep")
    ap.add_argument("--layers", default="", help="capture layers (comma separated); overrides --drafter's")
    ap.add_argument("--out", default=None, help="output dir (default $KAKEYA_HOME/cache/drafter_teacher/cpu-features)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence at most (an item's last seq-len)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per engine forward (forward_batch)")
    ap.add_argument("--generate", type=int, default=0,
                    help="N > 0: self-generated continuations instead of teacher forcing: each item's prompt (its last "
                         "seq-len - N tokens) then the engine's own greedy continuation, up to N tokens or an eos, "
                         "features captured on the way (a plan of its own: use another --out)")
    ap.add_argument("--gen-batch", type=int, default=16, help="with --generate: sequences decoded together (their decode "
                                                              "rows in one forward, as the daemon batches sessions)")
    ap.add_argument("--max-tokens", type=int, default=TOKENS_4M, help="tokens planned (the plan stops at this)")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop starting chunks after this long (0 = none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", default="greedy", choices=["greedy", "full"],
                    help="argmax through the head's greedy path (what greedy decoding emits; default) or the full "
                         "logits (the runs before 2026-11-29 21st session: progress.json's runs say which)")
    ap.add_argument("--step", default="auto", choices=["auto", "native", "pieces"],
                    help="native: the native CPU step (captured layers come out of its one C++ call); pieces: every op "
                         "from Python; auto: native where it builds, as the daemon's --compile auto on the CPU")
    ap.add_argument("--corpus-files", type=int, default=20000, help="gpu_corpus.build max_files")
    ap.add_argument("--corpus-seconds", type=float, default=120.0, help="gpu_corpus.build deadline")
    ap.add_argument("--man-pages", type=int, default=300)
    ap.add_argument("--no-packages", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate-json", default="", help="write the measured rate and disk per token here")
    ap.add_argument("--merge-rates", nargs="+", default=[], metavar="RATE_JSON",
                    help="only merge these --rate-json runs (one per --step / --generate) into --rate-json, with their "
                         "ratios")
    return ap.parse_args(argv)


def capture_layers(args) -> tuple[int, ...]:
    if args.layers:
        return tuple(int(x) for x in args.layers.split(","))
    from kv_cache_proposer import resolve_checkpoint

    man = json.loads((resolve_checkpoint(args.drafter) / "manifest.json").read_text())
    return tuple(int(x) for x in man["config"]["capture_layers"])


def load_tokenizer(path: pathlib.Path):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError):
        return None


def heldout_first_lines(ptok: gpu_corpus.PromptTokenizer) -> set:
    """First lines of the benchmark's held-out code prompts (as gpu_drafter_run keeps them out of training)."""
    from kv_cache_proposer import CHECKPOINTS_DIR

    f = CHECKPOINTS_DIR / "smollm2-135m-dlm" / "heldout_prompts.json"
    if ptok.tok is None or not f.exists():
        return set()
    held = json.loads(f.read_text())
    return {gpu_corpus.first_lines(ptok.decode(p["ids"])) for p in held.get("code", [])}


def plan(args, ptok: gpu_corpus.PromptTokenizer, layers: tuple[int, ...], log=print) -> dict:
    """Build the corpus and tokenize its training items in gpu_corpus.interleave's order, up to --max-tokens."""
    t0 = time.monotonic()
    corpus = gpu_corpus.build(seed=args.seed, max_files=args.corpus_files, deadline=time.monotonic() + args.corpus_seconds,
                              packages=not args.no_packages, man_pages=args.man_pages,
                              heldout_first_lines=heldout_first_lines(ptok), log=log)
    jobs, tokens = [], 0
    per: dict = {}
    for it in gpu_corpus.interleave(corpus.train):
        if tokens >= args.max_tokens:
            break
        ids = ptok.ids(it)[-(args.seq_len - args.generate) :]
        ids = ids[: max(0, args.max_tokens - tokens - args.generate)]
        if len(ids) < 2:
            continue
        jobs.append({"kind": it.style, "key": it.key, "source": it.source, "ids": ids})
        n = len(ids) + args.generate  # generated: at most --generate more (an eos ends it sooner)
        tokens += n
        e = per.setdefault(f"{it.style}/{it.source}", {"sequences": 0, "tokens": 0})
        e["sequences"] += 1
        e["tokens"] += n
    desc = {
        "stage": ("scripts/training/cpu_features.py: the daemon's engine teacher-forced over corpus text (no generation)"
                  if not args.generate else
                  f"scripts/training/cpu_features.py --generate {args.generate}: corpus prompts, then the daemon's engine's "
                  "own greedy continuations (decode rows batched), features captured as it generates"),
        "sources": corpus.describe(),
        "tokenizer": ptok.kind,
        "seq_len": args.seq_len,
        "planned": {"sequences": len(jobs), "tokens": tokens, "max_tokens": args.max_tokens,
                    "corpus_items_train": len(corpus.train), "per_style_source": dict(sorted(per.items()))},
        "styles": STYLE_NOTE,
        "targets": ("corpus text, teacher-forced; argmax = the engine's greedy token at each position, so the trainer "
                    "supervises only blocks where the text agrees with it (no self-generated continuations)"
                    if not args.generate else
                    "prompt text (supervised where it agrees with the engine's argmax) then the engine's greedy "
                    "continuation (the argmax at every generated position is the next token: all supervised)"),
        "features": f"engine StepInput.capture of layers {list(layers)} (residual stream after each), fp16; final = the "
                    "engine's final normed hidden, fp16",
        "plan_seconds": round(time.monotonic() - t0, 1),
    }
    return {"layers": list(layers), "max_new": args.generate, "description": desc, "jobs": jobs}


@torch.inference_mode()
def features(model, seqs: list[list[int]], layers: tuple[int, ...], batch: int = 1, greedy: bool = True) -> list[tuple]:
    """Per sequence (feats (T, L*H) f16, final (T, H) f16, argmax (T,) i32), each sequence teacher-forced from
    position 0 in a fresh `full` cache through the engine's forward_batch (`batch` sequences per forward). greedy:
    the argmax through the head's greedy path (StepInput.greedy: what the engine's greedy decoding emits), else
    through the full logits (the head's sampled path: the same argmax but in rare near-ties, at more cost)."""
    from inference_engine.engine.steps import StepInput, forward_batch
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    out = []
    geo = model.geometry()
    for b in range(0, len(seqs), batch):
        part = seqs[b : b + batch]
        inputs = []
        for s in part:
            cache = make_cache(KVStrategy("full"), geo, max_step=len(s), max_context=max(len(s), model.spec.max_context))
            inputs.append(StepInput(model.tensor(s), range(len(s)), cache, "all", capture=layers, greedy=greedy))
        res = forward_batch(model, inputs)
        for inp, (logits, hidden) in zip(inputs, res):
            inp.cache.abort()
            out.append((inp.captured.half().cpu(), hidden.half().cpu(), logits.argmax(-1).int().cpu()))
    return out


@torch.inference_mode()
def generated_features(model, prompts: list[list[int]], layers: tuple[int, ...], max_new: int, eos, gen_batch: int = 16,
                       greedy: bool = True) -> list[tuple]:
    """Per prompt (ids, feats, final, argmax): the prompt teacher-forced (one forward, as features() does), then the
    engine's own greedy continuation, up to max_new tokens or an eos, each token fed as a decode row (row-exact,
    the decode rows of `gen_batch` sequences in one forward_batch, as the daemon batches sessions) with its features
    captured. ids = prompt + continuation; every id has its row (the last generated one is fed too), so argmax at a
    generated position is the next generated token, and at the last row what would follow."""
    from inference_engine.engine.steps import StepInput, forward_batch
    from inference_engine.kv.factory import make_cache
    from inference_engine.kv.strategy import KVStrategy

    geo, out = model.geometry(), []
    for b in range(0, len(prompts), gen_batch):
        seqs = []
        for p in prompts[b : b + gen_batch]:
            cache = make_cache(KVStrategy("full"), geo, max_step=len(p), max_context=max(len(p) + max_new, model.spec.max_context))
            inp = StepInput(model.tensor(p), range(len(p)), cache, "all", capture=layers, greedy=greedy)
            logits, hidden = forward_batch(model, [inp])[0]
            cache.commit(len(p))
            am = logits.argmax(-1).int().cpu()
            s = {"cache": cache, "ids": list(p), "n0": len(p), "rows": len(p), "feats": [inp.captured.half().cpu()],
                 "final": [hidden.half().cpu()], "argmax": [am]}
            if max_new > 0:
                s["ids"].append(int(am[-1]))
            seqs.append(s)
        while True:
            live = [s for s in seqs if s["rows"] < len(s["ids"])]  # a generated token not fed yet
            if not live:
                break
            inputs = [StepInput(model.tensor([s["ids"][s["rows"]]]), range(s["rows"], s["rows"] + 1), s["cache"], "last",
                                row_exact=True, capture=layers, greedy=greedy) for s in live]
            for s, inp, (logits, hidden) in zip(live, inputs, forward_batch(model, inputs)):
                inp.cache.commit(1)
                nxt = int(logits.argmax(-1).view(-1)[-1])
                s["feats"].append(inp.captured.half().cpu())
                s["final"].append(hidden.half().cpu())
                s["argmax"].append(torch.tensor([nxt], dtype=torch.int32))
                fed = s["ids"][s["rows"]]
                s["rows"] += 1
                if fed not in eos and len(s["ids"]) - s["n0"] < max_new:
                    s["ids"].append(nxt)
        for s in seqs:
            out.append((s["ids"], torch.cat(s["feats"]), torch.cat(s["final"]), torch.cat(s["argmax"]), s["n0"]))
    return out


def supervised_slots(ok: torch.Tensor, block: int = 4) -> int:
    """What the trainer can learn from, in draft slots: ok[t] = the argmax at t is the token at t + 1 (within a
    sequence); an anchor at t + 1 supervises its k-th slot while ok holds from t on for k positions (AnchorSampler's
    run length), at most `block`; summed over every position."""
    run, total = 0, 0
    for v in reversed(ok.tolist()):
        run = run + 1 if v else 0
        total += min(run, block)
    return total


def write_chunk(model, items: list[dict], layers: tuple[int, ...], batch: int, path: pathlib.Path,
                greedy: bool = True, generate: int = 0, gen_batch: int = 16) -> dict:
    from safetensors.torch import save_file

    prompts = [j["ids"] for j in items]
    if generate:
        gen = generated_features(model, prompts, layers, generate, set(model.spec.eos_token_ids), gen_batch, greedy)
        seqs, res, starts = [g[0] for g in gen], [g[1:4] for g in gen], [g[4] for g in gen]
    else:
        seqs = prompts
        res = features(model, seqs, layers, batch, greedy)
        starts = [len(s) for s in seqs]
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    tensors = {
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "feats": torch.cat([r[0] for r in res]).contiguous(),
        "final": torch.cat([r[1] for r in res]).contiguous(),
        "argmax": torch.cat([r[2] for r in res]).contiguous(),
        "seq_offsets": torch.tensor(offsets, dtype=torch.int64),
        "gen_start": torch.tensor(starts, dtype=torch.int64),
        "style": torch.tensor([dflash_data.STYLES[j["kind"]] for j in items], dtype=torch.int64),
    }
    agree = (tensors["argmax"][:-1].long() == tensors["tokens"][1:].long())
    ends = torch.zeros_like(agree)
    ends[torch.tensor(offsets[1:-1], dtype=torch.long) - 1] = True  # the last row of a sequence has no next token
    slots = supervised_slots(agree & ~ends)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return {"sequences": len(seqs), "tokens": offsets[-1], "bytes": path.stat().st_size,
            "generated": offsets[-1] - sum(starts), "supervised_slots": slots,
            "greedy_agreement": round(float(agree[~ends].float().mean()), 4) if agree.numel() else 0.0}


def disk_totals(out: pathlib.Path) -> tuple[int, int, int]:
    """(chunks, tokens, bytes) of the chunks present."""
    from safetensors import safe_open

    n = tok = by = 0
    for p in sorted(out.glob("part-*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            tok += f.get_slice("tokens").get_shape()[0]
        by += p.stat().st_size
        n += 1
    return n, tok, by


def merge_rates(args) -> int:
    """Rate runs of the same corpus and box, one per --step, in one file: each run's rate and the ratio of each
    to the `pieces` run (the parts stay as they are)."""
    runs = {}
    for f in args.merge_rates:
        d = json.loads(pathlib.Path(f).read_text())
        step = d["config"].get("step", "auto")
        gen = d["config"].get("generate", 0)
        key = f"{step}/generate{gen}" if gen else step
        runs[key] = {"file": f, "commit": d["commit"], "cpu": d["machine"]["cpu"], "tokens_per_s": d["tokens_per_s"],
                     "generated": d["run"].get("generated", 0),
                     "supervised_slots_per_s": d.get("supervised_slots_per_s"),
                     "supervised_slots_per_token": d.get("supervised_slots_per_token"),
                     "tokens_per_cpu_second": d["tokens_per_cpu_second"], "tokens": d["run"]["tokens"],
                     "load_average_start_end": d["run"]["load_average_start_end"], "step": d.get("step"),
                     "projection_4M_tokens_hours": d["projection_4M_tokens"]["hours"],
                     "bytes_per_token_on_disk": d["bytes_per_token_on_disk"]}
    out = run_metadata({"merge_rates": args.merge_rates})
    out |= {"what": "cpu_features.py data stage rate per --step (and --generate), runs one after another on the same box",
            "runs": runs}
    if "pieces" in runs:
        out["ratio_to_pieces"] = {k: round(v["tokens_per_s"] / runs["pieces"]["tokens_per_s"], 3) for k, v in runs.items()}
    tf = next((v for k, v in runs.items() if "/generate" not in k and v.get("supervised_slots_per_s")), None)
    if tf is not None:  # issue 33: what the trainer can learn from per second, each kind of data against teacher forcing
        out["supervised_slots_per_s_vs_teacher_forcing"] = {
            k: round(v["supervised_slots_per_s"] / tf["supervised_slots_per_s"], 3)
            for k, v in runs.items() if v.get("supervised_slots_per_s")}
    write_json(pathlib.Path(args.rate_json), out)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge_rates:
        return merge_rates(args)
    torch.set_num_threads(args.threads)
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.model_store import resolve_model

    out = pathlib.Path(args.out).expanduser() if args.out else None
    if out is None:
        from kv_cache_proposer.training.teacher import default_teacher_dir

        out = default_teacher_dir("cpu-features")
    out.mkdir(parents=True, exist_ok=True)
    layers = capture_layers(args)
    path = resolve_model(args.model)
    t_load = time.monotonic()
    model = TorchCausalLM.load(path, weights=args.weights)
    if args.step != "pieces" and not model.use_native_step() and args.step == "native":
        raise SystemExit("--step native: the native CPU step is unavailable here (see the log); use --step pieces")
    load_s = time.monotonic() - t_load
    if max(layers) >= model.spec.num_layers:
        raise SystemExit(f"capture layers {list(layers)} outside the model's {model.spec.num_layers} layers")
    ptok = gpu_corpus.PromptTokenizer(load_tokenizer(path), int(model.embed.shape[0]))
    jobs_file = out / "jobs.json"
    if jobs_file.exists():
        spec = json.loads(jobs_file.read_text())
        if tuple(spec["layers"]) != layers:
            raise SystemExit(f"{jobs_file} was planned for layers {spec['layers']}, not {list(layers)}; use another --out")
        if spec.get("max_new", 0) != args.generate:
            raise SystemExit(f"{jobs_file} was planned with --generate {spec.get('max_new', 0)}, not {args.generate}; "
                             "use another --out")
        print(f"resuming {out}: {len(spec['jobs'])} sequences planned", flush=True)
    else:
        spec = plan(args, ptok, layers)
        spec["description"]["engine"] = {"model": str(path), "weights": args.weights, "model_id": model.model_id}
        jobs_file.write_text(json.dumps(spec))
        write_json(out / "manifest.json", {"layers": list(layers), "engine": spec["description"]["engine"],
                                           **{k: v for k, v in spec["description"].items() if k != "engine"}})
    chunks = dflash_data.chunk_jobs(spec["jobs"])
    t0, cpu0, load0 = time.monotonic(), time.process_time(), os.getloadavg()
    done = {"chunks": 0, "sequences": 0, "tokens": 0, "generated": 0, "supervised_slots": 0, "bytes": 0,
            "forward_seconds": 0.0}
    agree = []
    written = []  # which chunks this run wrote (so progress.json says which head made each)
    stopped = ""
    for c, items in enumerate(chunks):
        p = dflash_data.chunk_path(out, c)
        if p.exists():
            continue
        if args.minutes and time.monotonic() - t0 >= args.minutes * 60:
            stopped = f"--minutes {args.minutes} spent before chunk {c}"
            break
        tc = time.monotonic()
        info = write_chunk(model, items, layers, args.batch, p, args.head == "greedy", args.generate, args.gen_batch)
        dt = time.monotonic() - tc
        written.append(c)
        done["chunks"] += 1
        done["sequences"] += info["sequences"]
        done["tokens"] += info["tokens"]
        done["generated"] += info["generated"]
        done["supervised_slots"] += info["supervised_slots"]
        done["bytes"] += info["bytes"]
        done["forward_seconds"] += dt
        agree.append((info["greedy_agreement"], info["tokens"]))
        print(f"chunk {c}/{len(chunks)}: {info['sequences']} seqs {info['tokens']} tokens {dt:.1f}s "
              f"({info['tokens'] / dt:.0f} tok/s) {info['bytes'] / info['tokens']:.0f} B/token "
              f"agreement {info['greedy_agreement']} generated {info['generated']} "
              f"supervised slots {info['supervised_slots']} ({info['supervised_slots'] / dt:.0f}/s)", flush=True)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    n_chunks, tok_all, bytes_all = disk_totals(out)
    rate = done["tokens"] / wall if wall > 0 and done["tokens"] else 0.0
    bpt = bytes_all / tok_all if tok_all else 0.0
    run = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": args.threads, "batch": args.batch,
           "head": args.head, "chunks_written_first_last": [written[0], written[-1]] if written else [],
           **done, "wall_seconds": round(wall, 1), "tokens_per_s": round(rate, 1), "load_seconds": round(load_s, 1),
           "process_cpu_seconds": round(cpu, 1), "tokens_per_cpu_second": round(done["tokens"] / cpu, 1) if cpu > 0 else 0.0,
           "load_average_start_end": [list(load0), list(os.getloadavg())],
           "stopped": stopped or ("all planned chunks present" if n_chunks == len(chunks) else "")}
    prog_file = out / "progress.json"
    prog = json.loads(prog_file.read_text()) if prog_file.exists() else {"runs": []}
    prog["runs"].append(run)
    prog.update(chunks_present=n_chunks, chunks_planned=len(chunks), tokens_present=tok_all, bytes_present=bytes_all,
                bytes_per_token=round(bpt, 1))
    prog_file.write_text(json.dumps(prog, indent=2) + "\n")
    print(f"this run: {done['tokens']} tokens in {wall:.1f}s = {rate:.1f} tok/s; on disk {n_chunks}/{len(chunks)} chunks, "
          f"{tok_all} tokens, {bytes_all} bytes = {bpt:.0f} B/token", flush=True)
    if args.rate_json:
        H = int(model.embed.shape[1])
        agr = sum(a * n for a, n in agree) / max(1, sum(n for _, n in agree))
        payload = run_metadata({k: v for k, v in vars(args).items()})
        payload.update({
            "what": "cpu_features.py data stage rate: the engine's int4 forward with capture, teacher-forced, written as fp16 chunks",
            "model": str(path), "weights": args.weights, "capture_layers": list(layers), "hidden": H,
            "step": model.describe_step(),
            "run": run, "greedy_agreement_of_text": round(agr, 4),
            "tokens_per_s": round(rate, 1),
            "supervised_slots_per_s": round(done["supervised_slots"] / wall, 1) if wall > 0 else 0.0,
            "supervised_slots_per_token": round(done["supervised_slots"] / done["tokens"], 3) if done["tokens"] else 0.0,
            "forward_tokens_per_s": round(done["tokens"] / done["forward_seconds"], 1)
            if done["forward_seconds"] else 0.0,
            "tokens_per_cpu_second": run["tokens_per_cpu_second"],
            "contention": "the 2-core box is shared: load_average_start_end and process_cpu_seconds / (wall_seconds * threads) "
                          "say how much of the cores this run had; tokens_per_cpu_second is the rate per core-second it got",
            "bytes_per_token_on_disk": round(bpt, 1),
            "bytes_per_token_expected": len(layers) * H * 2 + H * 2 + 4 + 4,
            "projection_4M_tokens": {"hours": round(TOKENS_4M / rate / 3600, 2) if rate else None,
                                     "disk_GB": round(TOKENS_4M * bpt / 1e9, 2),
                                     "note": "at this run's rate and disk per token, same threads; the "
                                             "trainer maps feats and final from the chunk files (load_chunks "
                                             "mapped=True), so RAM need not hold them"},
            "seconds_since_start": round(time.monotonic() - T0, 1),
        })
        write_json(ROOT / args.rate_json if not os.path.isabs(args.rate_json) else pathlib.Path(args.rate_json), payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
