#!/usr/bin/env python
"""Train the v2 block drafter (DFlash-style, `smollm2-135m-dflash`) on a bare CUDA machine in one command,
within --minutes of wall clock, and write everything needed to ship it into --out.

    PYTHONPATH=.:wire/python:sdks/python python scripts/training/gpu_drafter_run.py \\
        --model-dir /path/to/smollm2-135m-instruct --minutes 8 --out /path/to/out

Stages (each logged with its timings; the plan is in the manifest):
  setup    load the verifier (transformers, fp32 by default; the daemon serves fp32 on CUDA) and its tokenizer
  corpus   prompts from the Python stdlib, the installed packages' sources and docs, man pages where present
           and kv_cache_proposer/data/chat_prompts.jsonl (training/gpu_corpus.py); held-out keys by hash
  eval-gen the verifier's continuations of the held-out prompts (the benchmark's held-out prompts when the
           verifier is SmolLM2, plus the corpus's held-out split), with their features
  data     the verifier's greedy continuations of the training prompts in large batches, capturing the
           residual stream after the drafter's conditioning layers (training/gpu_data.py)
  train    the drafter on the device (training/gpu_train.py), after generation (--schedule sequential, the
           default: measured better in the time, docs/drafters.md) or during it (overlap: a generation thread
           feeds the buffer the training loop samples from)
  export   drafter.safetensors (fp16, <= 16 MB) + manifest.json, through kv_cache_proposer.save_drafter
  eval     acceptance per slot and tokens per verify step at k = 4 on the held-out continuations, for the
           new drafter and the shipped one, same sequences, same features -> eval.json
A watchdog writes the manifest, eval JSON and the best weights so far and exits if the stages overrun the
budget: the command always ends before --minutes with its outputs written (the manifest says what was cut).
Needs only torch, transformers, safetensors and numpy; imports nothing of inference_engine.

--out holds: drafter.safetensors, manifest.json, eval.json, run.log (4 files, flat).
"""
from __future__ import annotations

import time

T0 = time.monotonic()  # the budget counts from here (before the heavy imports)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kv_cache_proposer.dflash_model import DFlashConfig, DFlashModel  # noqa: E402
from kv_cache_proposer.drafter import CHECKPOINTS_DIR, MANIFEST_FILE, WEIGHTS_FILE, load_drafter, save_drafter  # noqa: E402
from kv_cache_proposer.training import gpu_corpus, gpu_data, gpu_train  # noqa: E402
from kv_cache_proposer.training.dflash_trainer import LossWeights  # noqa: E402

MAX_FILE_BYTES = 16 * 1024 * 1024
SHIPPED_LAYERS = (1, 8, 15, 22, 28)
BENCH_HELDOUT = CHECKPOINTS_DIR / "smollm2-135m-dlm" / "heldout_prompts.json"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="the verifier: a local HF directory (fp32 SmolLM2-135M-Instruct)")
    ap.add_argument("--minutes", type=float, required=True, help="wall-clock budget of the whole command")
    ap.add_argument("--out", required=True, help="output folder (checkpoint, manifest, eval JSON, log)")
    ap.add_argument("--name", default="smollm2-135m-dflash")
    ap.add_argument("--device", default="auto", help="auto (cuda if present) | cuda | cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="recorded in the manifest")
    # schedule
    ap.add_argument("--schedule", default="sequential", choices=("sequential", "overlap"),
                    help="sequential: generate, then train (measured better: docs/drafters.md); overlap: train while a "
                         "generation thread adds data")
    ap.add_argument("--gen-frac", type=float, default=0.0,
                    help="share of the data+train window generation may use (0 = 0.5 sequential / 0.6 overlap)")
    # corpus
    ap.add_argument("--corpus-files", type=int, default=3000, help="source / doc files read at most")
    ap.add_argument("--corpus-seconds", type=float, default=0.0, help="corpus stage limit (0 = min(30 s, 6 %% of the budget))")
    ap.add_argument("--man-pages", type=int, default=300)
    ap.add_argument("--no-packages", action="store_true", help="stdlib + shipped prompts only")
    ap.add_argument("--max-prompts", type=int, default=0, help="training prompts at most (0 = all the corpus gives)")
    # generation
    ap.add_argument("--layers", default="auto", help="verifier layers the drafter conditions on (auto: 1,8,15,22,28 on 30 layers)")
    ap.add_argument("--max-new", type=int, default=96, help="tokens generated per training prompt")
    ap.add_argument("--gen-batch", type=int, default=1024, help="prompts per generate() call at most")
    ap.add_argument("--gen-batch-tokens", type=int, default=0,
                    help="prompts x (longest prompt + max-new) per call at most (0 = what the GPU's free memory allows, "
                         "at most 800k; 100k on the CPU)")
    ap.add_argument("--gen-dtype", default="fp32", choices=("fp32", "bf16"), help="verifier weights for generation and features")
    ap.add_argument("--gen-cache", default="dynamic", choices=("dynamic", "static"), help="generate()'s KV cache")
    ap.add_argument("--max-data-gb", type=float, default=0.0, help="device memory for the data buffer (0 = 25 %% of the GPU's, 1 on CPU)")
    # evaluation
    ap.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts per style and set")
    ap.add_argument("--eval-max-new", type=int, default=64, help="tokens per held-out continuation (the benchmark's 64)")
    ap.add_argument("--compare", default="smollm2-135m-dflash", help="shipped drafter evaluated beside the new one ('' = none)")
    # drafter
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--drafter-hidden", type=int, default=0, help="drafter width (0 = the verifier's)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--context-window", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="FR-Spec draft vocabulary (0 = full)")
    ap.add_argument("--init", default="scratch", choices=("scratch", "shipped"), help="start from random weights or --compare's")
    # training
    ap.add_argument("--windows", type=int, default=128, help="context windows per step")
    ap.add_argument("--anchors", type=int, default=16, help="blocks per window")
    ap.add_argument("--span", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--feat-dropout", type=float, default=0.1)
    ap.add_argument("--val-every-seq", type=int, default=16, help="every n-th sequence validates (best weights exported)")
    ap.add_argument("--log-every", type=int, default=0, help="steps between metric read-backs (0 = 50 on CUDA, 5 on CPU)")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="training ends after this many steps if they come before its deadline (0 = train until the deadline)")
    # tests: hang in this stage, its budget spent from that moment (the watchdog's deadline moved to now), so the
    # watchdog ends the run there however long the box took to reach the stage
    ap.add_argument("--test-stall", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def git_commit() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        return r.stdout.strip() if r.returncode == 0 else "unknown (no git checkout here)"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here)"


def auto_layers(n_layers: int) -> tuple[int, ...]:
    if n_layers == 30:
        return SHIPPED_LAYERS
    if n_layers <= 5:
        return tuple(range(n_layers))
    step = (n_layers - 3) / 4
    return tuple(sorted({int(round(1 + i * step)) for i in range(5)}))


class Run:
    """The run's record and its one writer (main thread at the end, or the watchdog when time runs out)."""

    def __init__(self, args, out: pathlib.Path, start: float):
        self.args, self.out, self.start = args, out, start
        self.total = args.minutes * 60.0
        self.hard = start + self.total - max(2.0, 0.02 * self.total)  # the watchdog writes and exits here
        self.write_lock = threading.Lock()
        self.finished = False
        self.stages: dict = {}
        self.cut: list[str] = []
        self.manifest: dict = {}
        self.eval: dict = {"status": "not run yet"}
        self.trainer = None
        self.cfg: DFlashConfig | None = None
        self.embed_head = None  # callable -> (embed, head) on the CPU
        self.checkpoint_written = False
        out.mkdir(parents=True, exist_ok=True)
        self.log_f = open(out / "run.log", "a", buffering=1)

    def now(self) -> float:
        return time.monotonic() - self.start

    def log(self, msg: str) -> None:
        line = f"[{self.now():7.1f}s] {msg}"
        print(line, flush=True)
        try:
            self.log_f.write(line + "\n")
        except ValueError:
            pass

    @contextlib.contextmanager
    def stage(self, name: str, **plan):
        t = self.now()
        rec = self.stages.setdefault(name, {})
        rec.update(start_s=round(t, 2), **{k: round(v, 2) if isinstance(v, float) else v for k, v in plan.items()})
        self.log(f"== {name}: start" + (" (" + ", ".join(f"{k} {v:.1f}s" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in plan.items()) + ")" if plan else ""))
        try:
            yield rec
            rec.setdefault("status", "done")
        except BaseException as e:
            rec["status"] = f"failed: {type(e).__name__}: {e}"
            raise
        finally:
            rec["end_s"] = round(self.now(), 2)
            rec["seconds"] = round(rec["end_s"] - rec["start_s"], 2)
            self.log(f"== {name}: {rec.get('status', 'interrupted')} in {rec['seconds']:.1f}s")

    # ---- writing
    def _write_json(self, name: str, obj: dict) -> None:
        p = self.out / name
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        os.replace(tmp, p)

    def run_record(self, completed: bool) -> dict:
        return {"minutes": self.args.minutes, "completed": completed, "cut_short": list(self.cut),
                "wall_seconds": round(self.now(), 1), "stages": self.stages,
                "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}

    def write(self, completed: bool) -> None:
        """manifest.json (merged into save_drafter's) and eval.json; the log says where they went."""
        man = dict(self.manifest)
        man["run"] = self.run_record(completed)
        p = self.out / MANIFEST_FILE
        if p.exists():
            try:
                prev = json.loads(p.read_text())
            except ValueError:
                prev = {}
            keep = {k: prev[k] for k in ("format", "config", "weights", "weights_dtype", "trainable_params") if k in prev}
            man = {**keep, **man}
        self._write_json(MANIFEST_FILE, man)
        ev = dict(self.eval)
        ev["command"] = self.manifest.get("training", {}).get("command", "scripts/training/gpu_drafter_run.py")  # results/ hygiene
        ev["run"] = {"completed": completed, "cut_short": list(self.cut), "wall_seconds": round(self.now(), 1)}
        self._write_json("eval.json", ev)

    def export(self, state: dict, which: dict) -> None:
        """drafter.safetensors + manifest through save_drafter (the loader's format), from a state dict."""
        embed, head = self.embed_head()
        m = DFlashModel(self.cfg, embed, head)
        m.load_state_dict({k: v.to("cpu") for k, v in state.items()}, strict=False)
        m.set_draft_vocab(state["draft_vocab"].to("cpu"))
        self.manifest.setdefault("training", {})["exported"] = which
        save_drafter(m, self.out, self.manifest)
        self.checkpoint_written = True
        size = (self.out / WEIGHTS_FILE).stat().st_size
        self.manifest["training"]["checkpoint_bytes"] = size
        if size > MAX_FILE_BYTES:
            self.cut.append(f"checkpoint is {size} bytes, over the 16 MB limit")

    def emergency(self) -> None:
        """The watchdog: write what there is, state what was cut, and end the process."""
        got = self.write_lock.acquire(timeout=max(0.1, self.start + self.total - 0.5 - time.monotonic()))
        if self.finished:
            if got:
                self.write_lock.release()
            return
        try:
            if not got:
                self.cut.append("watchdog: the main thread held the writer past the budget; written over it")
            self.log(f"!! watchdog: budget nearly spent at {self.now():.1f}s of {self.total:.0f}s; writing what there is and exiting")
            running = [n for n, r in self.stages.items() if "end_s" not in r]
            self.cut.append(f"watchdog at {self.now():.1f}s: stages still running: {running or 'none'}")
            for n in running:
                self.stages[n]["status"] = "cut by the watchdog"
            tr = self.trainer
            if not self.checkpoint_written and tr is not None and tr.snapshot_cpu is not None and self.cfg is not None:
                try:
                    self.export(tr.snapshot_cpu, {"which": "snapshot (watchdog)", "step": tr.snapshot_step})
                except Exception as e:  # noqa: BLE001
                    self.cut.append(f"watchdog checkpoint failed: {type(e).__name__}: {e}")
            elif not self.checkpoint_written:
                self.cut.append("no checkpoint: cut before training produced weights")
            if self.eval.get("status") != "complete":
                self.eval["status"] = "cut by the watchdog: " + str(self.eval.get("status"))
            self.write(completed=False)
            self.log("!! watchdog: outputs written: " + ", ".join(sorted(p.name for p in self.out.iterdir())))
        finally:
            try:
                self.log_f.flush()
            finally:
                os._exit(0)

    def start_watchdog(self) -> None:
        def wd():
            while time.monotonic() < self.hard:
                time.sleep(min(0.5, max(0.01, self.hard - time.monotonic())))
            if not self.finished:
                self.emergency()

        threading.Thread(target=wd, name="watchdog", daemon=True).start()


# ------------------------------------------------------------------------------------------------ stages

def load_verifier(args, run: Run, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pathlib.Path(args.model_dir).expanduser()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    embed = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings().weight.detach().clone()
    if args.gen_dtype == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError):
        tok = None
    eos = set()
    if tok is not None and tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    e = model.config.eos_token_id
    for x in (e if isinstance(e, list) else [e]):
        if x is not None:
            eos.add(int(x))
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else model.config.pad_token_id
    pad = int(pad if pad is not None else (min(eos) if eos else 0))
    return model, tok, embed, head, sorted(eos), pad


def bench_heldout(ptok: gpu_corpus.PromptTokenizer, n: int) -> tuple[dict, str]:
    """The benchmark's held-out prompts (scripts/bench_speculative.py's chat / code / edit), when the verifier's
    tokenizer is the one they were tokenized with; else ({}, why not)."""
    if not BENCH_HELDOUT.exists():
        return {}, f"{BENCH_HELDOUT} is missing"
    if ptok.tok is None:
        return {}, "the verifier has no tokenizer"
    held = json.loads(BENCH_HELDOUT.read_text())
    c0, k0 = held["chat"][0], held["code"][0]
    if (ptok.chat(c0["text"]) != c0["ids"] or ptok.encode(k0["text"])[-192:] != k0["ids"]
            or max(max(p["ids"]) for p in held["code"]) >= ptok.V):
        return {}, "the verifier's tokenizer does not reproduce the benchmark's held-out prompt ids"
    out = {"chat": [(p["key"], p["ids"]) for p in held["chat"][:n]], "code": [(p["key"], p["ids"]) for p in held["code"][:n]]}
    edit = []
    for p in held["code"][:n]:
        code = ptok.decode(p["ids"][:200])
        edit.append((p["key"], ptok.chat(f"{gpu_corpus.EDIT_INSTRUCTION}\n\n```python\n{code}\n```")))
    out["edit"] = edit
    return out, ""


def gen_batches(jobs, ptok, args, max_new, first: int = 0):
    """Tokenized batches (items, prompt ids) in the jobs' order by pools, each pool sorted by length and cut by
    --gen-batch / --gen-batch-tokens (prompt padding is what it costs); a pool's small remainder joins the next
    pool (a generate() call costs about the same per step for 1 prompt as for 512)."""
    pool = max(args.gen_batch * 2, 64)
    carry: list = []
    for i in range(0, len(jobs), pool):
        items = carry + jobs[i : i + pool]
        ids = [ptok.ids(it) for it in items]
        ok = [j for j in range(len(items)) if len(ids[j]) >= 2]
        order = sorted(ok, key=lambda j: len(ids[j]))
        cur: list[int] = []
        out = []
        for j in order:
            L = len(ids[j])
            if cur and (len(cur) + 1 > args.gen_batch or (len(cur) + 1) * (L + max_new) > args.gen_batch_tokens):
                out.append(cur)
                cur = []
            cur.append(j)
        last = i + pool >= len(jobs)
        carry = []
        if cur and (last or len(cur) >= args.gen_batch // 2 or not out):
            out.append(cur)
        elif cur:
            carry = [items[x] for x in cur]
        for b in out:
            if first and len(b) > first:  # the first batch is smaller: it measures the throughput the deadline checks use
                yield [items[x] for x in b[:first]], [ids[x] for x in b[:first]]
                b = b[first:]
            first = 0
            yield [items[x] for x in b], [ids[x] for x in b]


class _IdsTok:
    """gen_batches' tokenizer for prompts already tokenized: (style, key) -> ids."""

    def __init__(self, ids_of: dict):
        self.ids_of = ids_of

    def ids(self, item) -> list[int]:
        return self.ids_of[item[1]]


class Generator:
    """Generates batches into a SeqBuffer until its deadline, the jobs run out, or the buffer is full."""

    def __init__(self, run: Run, model, capture, buf, eos, pad, args, device, stream=None):
        self.run, self.model, self.capture, self.buf = run, model, capture, buf
        self.eos, self.pad, self.args, self.device, self.stream = eos, pad, args, device, stream
        self.batches = 0
        self.seconds = 0.0
        self.prompt_tokens = 0
        self.prompts_done = 0
        self.ends: list[str] = []
        self.error: str | None = None
        self.tok_per_s = None  # measured: tokens (prompt + max_new, padded) per second
        self.step_s = None  # measured: the fastest seconds per decode step (generate()'s per-step floor, any batch size)
        self.stop_reason = "jobs exhausted"

    def one(self, items, prompts, max_new, tag="gen", buf=None):
        """Generate one batch into `buf`; on a CUDA out-of-memory error, halve it (and --gen-batch-tokens)."""
        try:
            return self._one(items, prompts, max_new, tag, buf)
        except torch.OutOfMemoryError:
            if len(prompts) < 2:
                raise
            self.capture.reset()
            torch.cuda.empty_cache()
            self.args.gen_batch_tokens = max(1024, self.args.gen_batch_tokens // 2)
            self.run.log(f"!! {tag}: out of memory with {len(prompts)} prompts; "
                         f"halving (--gen-batch-tokens now {self.args.gen_batch_tokens})")
            h = len(prompts) // 2
            r1 = self.one(items[:h], prompts[:h], max_new, tag, buf)
            r2 = self.one(items[h:], prompts[h:], max_new, tag, buf)
            return r1[0] + r2[0], r1[1] + r2[1], r1[2] + r2[2]

    def _one(self, items, prompts, max_new, tag="gen", buf=None):
        buf = buf or self.buf
        t = time.monotonic()
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            gens, feats, final, am, pad_left = gpu_data.generate_batch(
                self.model, self.capture, prompts, max_new, self.eos, self.pad,
                cache_implementation="static" if self.args.gen_cache == "static" else None)
            styles = [it.style if hasattr(it, "style") else it[0] for it in items]
            keys = [it.key if hasattr(it, "key") else it[1] for it in items]
            taken = buf.add(prompts, gens, feats, final, am, pad_left, styles, keys, stream=self.stream)
            del feats, final, am
        if self.device.type == "cuda" and self.stream is None:
            torch.cuda.synchronize(self.device)
        dt = time.monotonic() - t
        padded = len(prompts) * (max(len(p) for p in prompts) + max_new)
        rate = padded / max(dt, 1e-6)
        self.tok_per_s = rate if self.tok_per_s is None else 0.5 * self.tok_per_s + 0.5 * rate
        steps = max((len(g) for g in gens), default=0)
        if steps:
            self.step_s = dt / steps if self.step_s is None else min(self.step_s, dt / steps)
        n_gen = sum(len(g) for g in gens[:taken])
        n_prompt = sum(len(p) for p in prompts[:taken])
        st = {}
        for s in styles[:taken]:
            st[s] = st.get(s, 0) + 1
        self.run.log(f"{tag} batch: {len(prompts)} prompts ({', '.join(f'{k} {v}' for k, v in sorted(st.items()))}), "
                     f"{n_prompt} prompt + {n_gen} generated tokens in {dt:.2f}s ({n_gen / max(dt, 1e-6):,.0f} generated tok/s); "
                     f"buffer {buf.n:,} tokens ({buf.n * buf.bytes_per_token / 2**30:.2f} GiB)")
        return taken, dt, n_prompt

    def loop(self, batches, deadline: float, max_new: int, stop=None, first_deadline: float | None = None):
        """first_deadline: while the buffer is empty, batches may start until then (a run whose setup overran its
        plan still gets some data, when there is time before the evaluation)."""
        try:
            for items, prompts in batches:
                if stop is not None and stop():
                    self.stop_reason = "stopped"
                    return
                if self.buf.n == 0 and first_deadline is not None and time.monotonic() < first_deadline:
                    deadline = max(deadline, time.monotonic() + 1e-3)
                def est(n):  # seconds for the n shortest prompts: by measured throughput, at least the per-step floor
                    if not self.tok_per_s:
                        return 0.0
                    return 1.25 * max(n * (max(len(p) for p in prompts[:n]) + max_new) / self.tok_per_s,
                                      max_new * (self.step_s or 0.0))

                left = deadline - time.monotonic()
                if est(len(prompts)) > left:  # the shortest prompts that fit the time left, if still a useful batch
                    k = len(prompts)
                    while k >= max(16, len(prompts) // 8) and est(k) > left:
                        k //= 2
                    if k < max(16, len(prompts) // 8):
                        self.stop_reason = f"deadline (next batch needs ~{est(len(prompts)):.1f}s, {left:.1f}s left)"
                        return
                    items, prompts = items[:k], prompts[:k]
                taken, dt, n_prompt = self.one(items, prompts, max_new)
                self.batches += 1
                self.seconds += dt
                self.prompt_tokens += n_prompt
                self.prompts_done += taken
                if self.buf.full:
                    self.stop_reason = "buffer full (--max-data-gb)"
                    return
        except Exception as e:  # noqa: BLE001  (the trainer carries on with what is there)
            self.error = f"{type(e).__name__}: {e}"
            self.stop_reason = "error"
            self.run.log("!! generation failed: " + self.error + "\n" + traceback.format_exc())


def main(argv=None, start: float | None = None) -> int:
    args = parse_args(argv)
    start = T0 if start is None else start
    out = pathlib.Path(args.out).expanduser().resolve()
    run = Run(args, out, start)
    run.start_watchdog()
    try:
        return _main(args, run)
    except BaseException as e:  # noqa: BLE001
        run.log("!! failed: " + "".join(traceback.format_exception(e)))
        with run.write_lock:
            if not run.finished:
                run.cut.append(f"error: {type(e).__name__}: {e}")
                run.eval.setdefault("status", "not run")
                run.write(completed=False)
                run.finished = True
        return 1


def _main(args, run: Run) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                       (args.device if args.device != "auto" else "cpu"))
    total = run.total
    write_reserve = max(2.5, 0.02 * total)
    eval_reserve = max(3.0, 0.05 * total)
    work_end = run.hard - run.start - write_reserve  # relative seconds
    eval_at = work_end - eval_reserve
    gen_frac = args.gen_frac or (0.6 if args.schedule == "overlap" else 0.5)
    run.log(f"gpu_drafter_run: {args.minutes} min budget, device {dev}, schedule {args.schedule}; "
            f"plan: train/data until {eval_at:.1f}s, eval until {work_end:.1f}s, watchdog at {run.hard - run.start:.1f}s")
    as_script = bool(sys.argv) and sys.argv[0].endswith(".py")
    cmd = shlex.join([os.path.relpath(sys.argv[0], ROOT) if as_script else "scripts/training/gpu_drafter_run.py",
                      *(sys.argv[1:] if as_script else [])])
    import transformers

    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    run.manifest = {
        "name": args.name,
        "kind": "v2: DFlash-style block drafter conditioned on multi-layer verifier hidden states (dflash_model.py)",
        "training": {
            "script": "scripts/training/gpu_drafter_run.py", "command": cmd, "args": vars(args),
            "trained_on": {"device": dev.type, "device_name": dev_name, "platform": platform.platform(),
                           "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__,
                           "cuda": torch.version.cuda if dev.type == "cuda" else None},
            "commit": git_commit(), "note": args.note,
            "budget": {"minutes": args.minutes, "data_and_train_until_s": round(eval_at, 1), "eval_until_s": round(work_end, 1),
                       "watchdog_at_s": round(run.hard - run.start, 1), "schedule": args.schedule, "gen_frac": gen_frac},
        },
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    run.write(completed=False)

    # ---- setup
    with run.stage("setup") as rec:
        model, tok, embed, head, eos, pad = load_verifier(args, run, dev)
        run.embed_head = lambda: (embed, head)
        n_layers = model.config.num_hidden_layers
        layers = auto_layers(n_layers) if args.layers == "auto" else tuple(int(x) for x in args.layers.split(","))
        V, Hv = embed.shape
        cfg = DFlashConfig(vocab_size=V, verifier_hidden_size=Hv, capture_layers=layers, hidden_size=args.drafter_hidden or Hv,
                           num_layers=args.drafter_layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                           intermediate_size=args.intermediate, draft_vocab_size=args.draft_vocab if 0 < args.draft_vocab < V else 0,
                           context_window=args.context_window, block_size=args.block_size,
                           verifier=pathlib.Path(args.model_dir).expanduser().resolve().name)
        probe = DFlashModel(cfg, embed, head)
        n_params = sum(v.numel() for v in probe.state_dict().values() if v.is_floating_point())
        del probe
        if n_params * 2 > MAX_FILE_BYTES - 65536:
            raise SystemExit(f"the drafter has {n_params:,} parameters: {n_params * 2:,} bytes in fp16, over the 16 MB limit")
        run.cfg = cfg
        ptok = gpu_corpus.PromptTokenizer(tok, V)
        rec.update(verifier_layers=n_layers, capture_layers=list(layers), drafter_params=n_params, tokenizer=ptok.kind)
        run.log(f"verifier {cfg.verifier}: {n_layers} layers, hidden {Hv}, vocab {V}, weights {args.gen_dtype} on {dev}; "
                f"drafter conditions on layers {list(layers)}, {n_params:,} parameters; tokenizer {ptok.kind}")
    feat_src = (f"transformers forward of the verifier in {args.gen_dtype} on {dev.type} ({dev_name}); the daemon serves "
                "fp32 weights on CUDA and int4 on the CPU by default (kakeya serve --weights auto), so on the CPU the "
                "features it captures come from int4 weights")
    run.manifest["verifier"] = {"name": cfg.verifier, "path_at_training": str(pathlib.Path(args.model_dir).expanduser()),
                                "shares": "token embedding + LM head (frozen, passed in at load time, not stored)",
                                "captured_layers": list(layers), "features_from": feat_src,
                                "feature_definition": "residual stream after decoder layer i (forward hook on model.layers[i]; "
                                                      "= the engine's StepInput.capture), concatenated in layer order, stored fp16"}

    # ---- corpus
    bench, bench_why = bench_heldout(ptok, args.eval_prompts)
    firsts = {gpu_corpus.first_lines(ptok.decode(ids)) for _, ids in bench.get("code", [])}
    corpus_s = args.corpus_seconds or min(30.0, 0.06 * total)
    with run.stage("corpus", limit=corpus_s) as rec:
        corpus = gpu_corpus.build(seed=args.seed, max_files=args.corpus_files, deadline=time.monotonic() + corpus_s,
                                  packages=not args.no_packages, man_pages=args.man_pages, heldout_first_lines=firsts, log=run.log)
        jobs = gpu_corpus.interleave(corpus.train)
        if args.max_prompts:
            jobs = jobs[: args.max_prompts]
        rec.update(training_prompts=len(jobs), heldout_items=len(corpus.heldout))
    run.manifest["data"] = {"corpus": corpus.describe(), "training_prompts_planned": len(jobs)}

    # ---- buffer and batch sizes (before any generation: eval-gen batches by them too)
    if dev.type == "cuda":
        free, tot = torch.cuda.mem_get_info(dev)
        gb = args.max_data_gb or 0.25 * tot / 2**30
        gb = min(gb, max(0.5, free / 2**30 - 16))
    else:
        gb = args.max_data_gb or 1.0
    bpt = len(layers) * Hv * 2 + Hv * 2 + 5 * 8
    cap = min(int(gb * 2**30 / bpt), len(jobs) * (512 + args.max_new) + 16)  # no more than the prompts can fill
    if not args.gen_batch_tokens:  # generation's peak per batch token: fp32 K/V of every layer, prefill activations, captures
        c = model.config
        kv_width = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        per_tok = n_layers * 2 * kv_width * (getattr(c, "head_dim", None) or Hv // c.num_attention_heads) * 4 + 12 * Hv * 4 + bpt
        left = (free - cap * bpt) if dev.type == "cuda" else 0
        args.gen_batch_tokens = int(min(800_000, max(20_000, (left - 8 * 2**30) / per_tok))) if dev.type == "cuda" else 100_000
    # ---- held-out continuations (eval), generated first: they also warm the device up
    cmp_model, cmp_why = None, ""
    if args.compare:
        try:
            from kv_cache_proposer.drafter import resolve_checkpoint

            ck = resolve_checkpoint(args.compare)
            ccfg = DFlashConfig.from_dict(json.loads((ck / MANIFEST_FILE).read_text())["config"])
            if (ccfg.vocab_size, ccfg.verifier_hidden_size) != (V, Hv) or max(ccfg.capture_layers) >= n_layers:
                cmp_why = (f"{args.compare} is for a verifier with vocab {ccfg.vocab_size}, hidden {ccfg.verifier_hidden_size}, "
                           f"layers {list(ccfg.capture_layers)}; this one has vocab {V}, hidden {Hv}, {n_layers} layers")
            else:
                cmp_model = load_drafter(str(ck), verifier_embed=embed, verifier_lm_head=head, device=dev).model
        except (FileNotFoundError, ValueError, KeyError) as e:
            cmp_why = f"{type(e).__name__}: {e}"
    eval_layers = tuple(sorted(set(layers) | (set(cmp_model.cfg.capture_layers) if cmp_model is not None else set())))
    eval_capture = gpu_data.LayerCapture(model, eval_layers, feat_dtype=torch.float32)
    eval_sets = {}
    if bench:
        eval_sets["bench_heldout"] = bench
    own: dict = {}
    for it in corpus.heldout:
        lst = own.setdefault(it.style, [])
        if len(lst) < args.eval_prompts:
            lst.append((it.key, ptok.ids(it)))
    eval_sets["corpus_heldout"] = own
    eval_items = [(style, f"{name}|{style}|{key}#{i}", ids) for name, st in eval_sets.items() for style, lst in st.items()
                  for i, (key, ids) in enumerate(lst) if len(ids) >= 2]  # '<set>|<style>|<source key>#<n>': unique
    n_eval_tok = sum(len(x[2]) + args.eval_max_new for x in eval_items)
    ebuf = gpu_data.SeqBuffer(n_eval_tok + 16, len(eval_layers) * Hv, Hv, dev, cfg.block_size, feat_dtype=torch.float32)
    capture = gpu_data.LayerCapture(model, layers, feat_dtype=torch.float16)
    genr = Generator(run, model, eval_capture, ebuf, eos, pad, args, dev)
    with run.stage("eval-gen", prompts=len(eval_items)) as rec:
        eg_deadline = run.now() + 0.15 * max(0.0, eval_at - run.now())
        pseudo = [(style, key) for style, key, _ in eval_items]
        ids_of = {key: ids for _, key, ids in eval_items}
        done = 0
        for items, prompts in gen_batches(pseudo, _IdsTok(ids_of), args, args.eval_max_new):
            if done and run.now() > eg_deadline:
                run.cut.append(f"eval-gen: {len(eval_items) - done} held-out prompts not generated (time)")
                break
            genr.one(items, prompts, args.eval_max_new, tag="eval-gen", buf=ebuf)
            done += len(items)
        rec.update(sequences=len(ebuf.seqs), tokens=ebuf.n)
    run.eval = {"status": "pending", "k": 4, "sets": {n: {s: len(v) for s, v in st.items()} for n, st in eval_sets.items()},
                "bench_heldout": ("scripts/bench_speculative.py's held-out prompts (" + str(BENCH_HELDOUT.relative_to(ROOT))
                                  + "): chat, code, "
                                  "and edit (the code wrapped in its editing request)") if bench else f"not used: {bench_why}",
                "corpus_heldout": f"this run's corpus, held-out keys ({corpus.stats['heldout_rule']})",
                "max_new_tokens": args.eval_max_new, "features_from": feat_src,
                "method": "offline replay of greedy speculative decoding at k = 4 along the verifier's own continuation "
                          "(training/gpu_train.py); alpha_per_slot = P(slot j accepted | slots before accepted) over verify steps; "
                          "tokens_per_verify_step = 1 + mean accepted drafts; every_position: the same at every position"}

    # ---- data + training
    buf = gpu_data.SeqBuffer(cap, len(layers) * Hv, Hv, dev, cfg.block_size, val_every=args.val_every_seq)
    run.log(f"data buffer: {cap:,} tokens ({cap * bpt / 2**30:.2f} GiB); {len(jobs)} training prompts queued; "
            f"generation batches of <= {args.gen_batch} prompts, <= {args.gen_batch_tokens:,} tokens")
    t_win0 = run.now()
    gen_end = t_win0 + gen_frac * max(0.0, eval_at - t_win0)
    stream = torch.cuda.Stream(dev) if (dev.type == "cuda" and args.schedule == "overlap") else None
    gen = Generator(run, model, capture, buf, eos, pad, args, dev, stream=stream)
    gen.step_s = genr.step_s  # generate()'s per-step floor; the throughput is measured on the first (smaller) batch
    batches = gen_batches(jobs, ptok, args, args.max_new, first=max(16, args.gen_batch // 4))
    log_every = args.log_every or (50 if dev.type == "cuda" else 5)
    tc = gpu_train.GpuTrainConfig(windows=args.windows, anchors=args.anchors, span=args.span, lr=args.lr, warmup=args.warmup,
                                  weight_decay=args.weight_decay, feat_dropout=args.feat_dropout, log_every=log_every,
                                  val_every_s=max(2.0, 0.05 * (eval_at - t_win0)), seed=args.seed, loss=LossWeights())
    trainer_box: dict = {}

    def make_trainer():
        counts = torch.zeros(V, dtype=torch.float64)
        n = buf.published
        counts += torch.bincount(buf.argmax[:n].cpu(), minlength=V).double()
        counts += 0.5 * torch.bincount(buf.tokens[:n].cpu(), minlength=V).double()
        dv = gpu_train.choose_draft_vocab(counts, cfg.draft_vocab_size, eos)
        init = None
        if args.init == "shipped" and cmp_model is not None:
            init = {k: v for k, v in cmp_model.state_dict().items() if k != "draft_vocab"}
        tr = gpu_train.Trainer(cfg, tc, embed, head, dv, dev, init_state=init, log=run.log)
        tr.take_snapshot()
        run.trainer = tr
        trainer_box["t"] = tr
        run.log(f"drafter: draft vocabulary {dv.numel()} tokens chosen from {n:,} buffered tokens; init {args.init}")
        if args.test_stall == "train":
            run.hard = time.monotonic()  # the watchdog thread reads it every <= 0.5 s
            threading.Event().wait()  # never set: the watchdog writes the outputs and ends the process
        return tr

    to_abs = lambda rel: run.start + rel  # noqa: E731

    def train(tr, t_tr) -> str:
        """Until eval_at, or --max-steps steps if they come first; says why it stopped."""
        enough = (lambda: tr.step >= args.max_steps) if args.max_steps else None
        why = tr.train_until(buf, to_abs(eval_at), (to_abs(t_tr), to_abs(eval_at)), stop=enough)
        return f"--max-steps {args.max_steps}" if why == "stopped" else why

    if args.schedule == "sequential":
        with run.stage("data", until=gen_end) as rec:
            gen.loop(batches, to_abs(gen_end), args.max_new, first_deadline=to_abs(eval_at))
            rec.update(stop=gen.stop_reason, batches=gen.batches, **buf.stats())
        t_tr = run.now()
        with run.stage("train", until=eval_at) as rec:
            if buf.anchors("train").numel() == 0:
                run.cut.append("train: no training data")
                rec["status"] = "skipped: no data"
            else:
                tr = make_trainer()
                rec.update(stop=train(tr, t_tr), steps=tr.step)
    else:
        with run.stage("data+train", gen_until=gen_end, until=eval_at) as rec:
            stop_gen = threading.Event()
            th = threading.Thread(target=gen.loop, args=(batches, to_abs(gen_end), args.max_new, stop_gen.is_set, to_abs(eval_at)),
                                  name="generate", daemon=True)
            th.start()
            while buf.anchors("train").numel() == 0 and th.is_alive() and run.now() < eval_at:
                time.sleep(0.05)
            if buf.anchors("train").numel() == 0:
                run.cut.append("train: no training data")
                rec["status"] = "skipped: no data"
            else:
                t_tr = run.now()
                tr = make_trainer()
                rec.update(stop=train(tr, t_tr), steps=tr.step)
            stop_gen.set()
            th.join(timeout=max(0.1, to_abs(eval_at + 0.5 * eval_reserve) - time.monotonic()))
            if th.is_alive():
                run.cut.append("data: the generation thread was still in a batch when training ended (left running)")
            rec.update(gen_stop=gen.stop_reason, gen_batches=gen.batches, gen_seconds=round(gen.seconds, 1), **buf.stats())
    if gen.error:
        run.cut.append(f"data: generation stopped by an error: {gen.error}")
    dstats = buf.stats()
    gen_record = {"sequences": dstats["sequences"], "tokens": dstats["tokens"], "generated_tokens": dstats["generated_tokens"],
                  "prompt_tokens": dstats["tokens"] - dstats["generated_tokens"], "per_style": dstats["per_style"],
                  "prompts_generated": gen.prompts_done, "prompts_not_reached": len(jobs) - gen.prompts_done,
                  "batches": gen.batches, "generate_seconds": round(gen.seconds, 1), "stopped_by": gen.stop_reason,
                  "max_new_tokens": args.max_new, "weights": args.gen_dtype, "kv_cache": args.gen_cache,
                  "batch_prompts_max": args.gen_batch, "batch_tokens_max": args.gen_batch_tokens,
                  "generated_tokens_per_s": round(dstats["generated_tokens"] / max(gen.seconds, 1e-6), 1),
                  "anchors": {"train": dstats["anchors_train"], "validation": dstats["anchors_val"]},
                  "validation_rule": f"every {args.val_every_seq}th generated sequence (best validated weights exported)",
                  "targets": "the verifier's own greedy continuations; features captured during generate() "
                             "(prefill rows, then one row per step)"}
    run.manifest["data"]["generation"] = gen_record
    if gen.stop_reason.startswith("deadline") or gen.stop_reason == "buffer full (--max-data-gb)":
        run.manifest["data"]["generation"]["note"] = f"{len(jobs) - gen.prompts_done} planned prompts not generated ({gen.stop_reason})"

    # ---- export
    tr = trainer_box.get("t")
    with run.stage("export") as rec:
        if tr is None:
            run.cut.append("export: nothing trained, no checkpoint")
            rec["status"] = "skipped"
        else:
            state, which = tr.final_state(buf)
            lens = torch.tensor([m["end"] - m["start"] for m in buf.seqs], device=dev)
            gstart = torch.repeat_interleave(torch.tensor([m["gen_start"] for m in buf.seqs], device=dev), lens)
            greedy = buf.tokens[: gstart.numel()][torch.arange(gstart.numel(), device=dev) >= gstart]
            cov = float(torch.isin(greedy, tr.model.draft_vocab).float().mean()) if greedy.numel() else None
            run.manifest["data"]["draft_vocab_coverage_of_generated_tokens"] = round(cov, 4) if cov is not None else None
            hist = tr.history
            step_s = tr.train_s / max(1, tr.step)
            run.manifest["training"].update({
                "config": {**{k: v for k, v in tc.__dict__.items() if k != "loss"}, "loss": tc.loss.__dict__},
                "steps_done": tr.step, "train_seconds": round(tr.train_s, 1), "seconds_per_step": round(step_s, 4),
                "blocks_per_step": tc.windows * tc.anchors, "blocks_seen": tr.step * tc.windows * tc.anchors,
                "history": hist if len(hist) <= 200 else hist[:: max(1, len(hist) // 200)] + hist[-1:],
            })
            with run.write_lock:
                run.export(state, which)
            rec.update(step=which.get("step"), bytes=run.manifest["training"]["checkpoint_bytes"])
            run.log(f"exported {which['which']} (step {which.get('step')}) -> {run.out / WEIGHTS_FILE} "
                    f"({run.manifest['training']['checkpoint_bytes']:,} bytes)")
    with run.write_lock:
        run.write(completed=False)

    # ---- eval
    with run.stage("eval", until=work_end) as rec:
        deadline = to_abs(work_end)
        res: dict = {}
        if tr is not None and run.checkpoint_written:
            newd = load_drafter(str(run.out), verifier_embed=embed, verifier_lm_head=head, device=dev)  # what ships
            res["new"] = gpu_train.evaluate(newd.model, ebuf, ebuf.seqs, eval_layers, span=64,
                                            windows=64 if dev.type == "cuda" else 8, deadline=deadline)
        else:
            res["new"] = {"skipped": "no checkpoint"}
        if cmp_model is not None:
            res["shipped"] = gpu_train.evaluate(cmp_model, ebuf, ebuf.seqs, eval_layers, span=64,
                                                windows=64 if dev.type == "cuda" else 8, deadline=deadline)
            res["shipped"]["name"] = args.compare
        else:
            res["shipped"] = {"skipped": cmp_why or "no --compare"}
        complete = all(r.get("complete", False) for r in res.values() if "skipped" not in r)
        headline = {}
        for set_name in eval_sets:
            for style in ("chat", "code", "edit", "all"):
                row = {}
                for who in ("new", "shipped"):
                    s = res[who].get(set_name, {}).get(style) if "skipped" not in res[who] else None
                    if s and s.get("verify_steps"):
                        row[who] = {"tokens_per_verify_step": s["tokens_per_verify_step"], "alpha_per_slot": s["alpha_per_slot"],
                                    "alpha": s["alpha"], "sequences": s["sequences"]}
                if row:
                    headline.setdefault(set_name, {})[style] = row
        run.eval.update(res)
        run.eval["headline_k4"] = headline
        run.eval["status"] = "complete" if complete else "partial (eval deadline)"
        if not complete:
            run.cut.append("eval: not every held-out sequence was evaluated (time)")
        run.manifest["eval"] = {"file": "eval.json", "k": 4, "headline": headline, "status": run.eval["status"]}
        for set_name, by_style in headline.items():
            for style, row in by_style.items():
                run.log(f"eval {set_name} {style}: " + "; ".join(
                    f"{who} {r['tokens_per_verify_step']:.2f} tok/step, alpha/slot {r['alpha_per_slot']}" for who, r in row.items()))
        rec["status"] = run.eval["status"]

    # ---- final write
    with run.write_lock:
        run.manifest["ship"] = (f"copy {WEIGHTS_FILE} and {MANIFEST_FILE} into kv_cache_proposer/checkpoints/{args.name}/ "
                                "(eval.json and run.log are the run's record)")
        run.write(completed=not run.cut)
        run.finished = True
    files = sorted(p for p in run.out.iterdir() if p.is_file())
    run.log("outputs: " + ", ".join(f"{p.name} ({p.stat().st_size:,} B)" for p in files))
    run.log(f"done in {run.now():.1f}s of {total:.0f}s" + (f"; cut short: {run.cut}" if run.cut else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
