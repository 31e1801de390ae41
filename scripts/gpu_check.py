"""GPU check (issue 28, item 5): is the daemon's engine exact and fast on one accelerator? One run, one JSON.

    python scripts/gpu_check.py --model-dir DIR      # an HF directory (config.json + safetensors)
    python scripts/gpu_check.py --gguf FILE          # a GGUF, converted first by the model store's converter
    python scripts/gpu_check.py --device cpu --quick --out /tmp/smoke.json   # the test suite's smoke run

Needs only the project tree and a model: no network, no `make setup` (docs/gpu.md lists the packages).
Everything runs in this process, each engine built as `kakeya serve` builds it (server/app.py:
load_model + build_runtime, --persist off) and driven through its Runtime, as the gRPC servicer does.
Sections, in this order, each recorded as ok / error / skipped (with the reason, a traceback tail, its wall
time), the JSON rewritten after every one, so a run cut short keeps what it measured:
  correctness     greedy tokens of `full` (fp32 weights, --compile off and auto) == transformers fp32 generate
  runs            every KV strategy (sink 4 / window 60 / pages of 16, so paged recalls pages) and drafter
  decode_batch1   one session's decode tok/s per strategy, --compile off and auto (the capture's gain)
  profile         where a batch-1 decode token's time goes (torch.profiler): host ops and device kernel time per
                  token for `full` and `paged` (and `full` --compile on, CUDA), and a chrome trace of a few `full`
                  tokens with Python stacks
  transformers_*  the controls: eager generate, and static cache + torch.compile (in a subprocess with a
                  time limit: a compile cannot be interrupted in-process)
  aggregate       aggregate decode tok/s at 1, 4 and 16 concurrent sessions (--batching on)
  ngram           prompt lookup at k = 4 over plain decoding on a code-editing prompt (same tokens)
  paged_long      `paged` (the daemon's defaults) at 1k, at the trained context and at 4x it (8k and 32k for
                  SmolLM2; past the context it attends in InfLLM's layout): time to first token and decode tok/s
Each --compile mode gets its own model, loaded by app.load_model as the daemon loads it (the step's
CUDA graphs belong to the model); the engines of a mode share it.
Then ratios and the issue's GPU targets, met or missed. A CPU run is labelled cpu-smoke and never
writes to the default --out: its figures are not GPU figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

T_START = time.perf_counter()
ROOT = pathlib.Path(__file__).resolve().parents[1]
# Runnable from a bare checkout: the packages and the generated stubs straight from the tree.
for _p in (ROOT / "sdks" / "python", ROOT / "wire" / "python", ROOT / "scripts", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_common import command_line, git_state  # noqa: E402

DEFAULT_OUT = ROOT / "results" / "gpu_check.json"
DRAFTERS = ("ngram", "smollm2-135m-dflash", "smollm2-135m-dlm")
RUN_KV = dict(sink=4, window=60, page_size=16, recall_pages=2)  # histories of ~200 tokens evict, page and recall
QUESTIONS = (
    "What is the capital of France, and what is it famous for?",
    "Explain in two sentences what a hash table is.",
    "Give three tips for writing readable Python code.",
)
EDIT_CODE = '''def summarize(orders, min_total=0):
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["price"]
        if customer not in totals:
            totals[customer] = 0
        totals[customer] += amount
    result = []
    for customer, total in totals.items():
        if total >= min_total:
            result.append((customer, round(total, 2)))
    result.sort(key=lambda row: row[1], reverse=True)
    return result'''
EDIT_REQUEST = f"Rename `totals` to `per_customer` in this function. Reply with the complete function only.\n\n```python\n{EDIT_CODE}\n```"


@dataclasses.dataclass(frozen=True)
class Scale:
    prompts: int = 4  # correctness prompts (3 questions + the code edit)
    correctness_tokens: int = 128
    speed_prompt: int = 128  # tokens of context before the timed decode
    speed_tokens: int = 128
    run_prompt: int = 200  # > sink + window of RUN_KV
    run_tokens: int = 32
    repeats: int = 3  # timed repeats per arm (median)
    reserve: float = 1.0  # multiplies each section's minimum time left to start
    long_context: tuple = (1024, 1.0, 4.0)  # paged_long: a short baseline (tokens), then multiples of the trained context
    long_tokens: int = 32  # paged_long: decoded tokens per length


FULL, QUICK = Scale(), Scale(prompts=2, correctness_tokens=8, speed_prompt=32, speed_tokens=16, run_prompt=120, run_tokens=8,
                             repeats=1, reserve=0.1, long_context=(120, 1.05), long_tokens=8)
# The sections in run order, and the seconds each needs left in --budget-s to start (times Scale.reserve);
# its arms check again. The compiled control's time limit leaves the later sections their minimum.
SECTIONS = {"correctness": 45, "runs": 40, "decode_batch1": 45, "profile": 20, "transformers_eager": 15,
            "transformers_static_compiled": 60, "aggregate": 40, "ngram": 25, "paged_long": 30}


class Budget(Exception):
    """Not enough of --budget-s left to start this part."""


# -- the run record -------------------------------------------------------------------------------------------
class Check:
    """The JSON being built: sections run in order, each caught and timed, the file rewritten after each."""

    def __init__(self, args, doc: dict):
        self.args, self.doc, self.t0 = args, doc, T_START  # the budget counts imports and model loading too
        self.scale = QUICK if args.quick else FULL
        if args.long_context:  # paged_long's lengths: a short baseline in tokens, then multiples of the trained context
            short, *multiples = (float(x) for x in args.long_context.split(","))
            self.scale = dataclasses.replace(self.scale, long_context=(int(short), *multiples))
        self.eager_output = None  # transformers eager's tokens, for the compiled control to compare with

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def need(self, seconds: float) -> None:
        if self.left() < seconds * self.scale.reserve:
            raise Budget(f"budget: {self.left():.1f} s of --budget-s {self.args.budget_s:g} left, "
                         f"this needs {seconds * self.scale.reserve:g}")

    def reserved_after(self, name: str) -> float:
        """Seconds the sections after `name` (those selected) need to start."""
        later = list(SECTIONS)[list(SECTIONS).index(name) + 1 :]
        return sum(SECTIONS[n] for n in later if not self.args.sections or n in self.args.sections) * self.scale.reserve

    def section(self, name: str, fn):
        sec = self.doc["sections"].setdefault(name, {})
        if self.args.sections and name not in self.args.sections:
            sec.update(status="skipped", reason="not in --sections")
            return None
        t = time.perf_counter()
        try:
            self.need(SECTIONS[name])
            sec["status"] = "running"
            self.write()
            sec.update(fn() or {})
            sec["status"] = "ok"
            sec["arm_errors"] = count_errors({k: v for k, v in sec.items() if k != "status"})
        except (Budget, Skip) as e:
            sec.update(status="skipped", reason=str(e))
        except Exception as e:  # noqa: BLE001 - one section's failure must not end the run
            sec.update(status="error", error=f"{type(e).__name__}: {e}", traceback=tail())
        sec["wall_s"] = round(time.perf_counter() - t, 2)
        note = sec.get("reason") or sec.get("error") or (f"{sec['arm_errors']} arm(s) failed" if sec.get("arm_errors") else "")
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {name}: {sec['status']} ({sec['wall_s']} s) {note}", flush=True)
        self.write()
        return sec

    def arm(self, fn, seconds: float = 5.0) -> dict:
        """One arm inside a section: its own status, so a failing strategy or drafter leaves the others measured."""
        t = time.perf_counter()
        try:
            self.need(seconds)
            out = {"status": "ok", **(fn() or {})}
        except (Budget, Skip) as e:
            out = {"status": "skipped", "reason": str(e)}
        except Exception as e:  # noqa: BLE001
            out = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": tail()}
        out["wall_s"] = round(time.perf_counter() - t, 2)
        return out

    def write(self) -> None:
        self.doc["total_wall_s"] = round(time.perf_counter() - self.t0, 2)
        path = pathlib.Path(self.args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str) + "\n")
        tmp.replace(path)  # a reader (or a timeout) never sees half a file


class Skip(Exception):
    """An arm that cannot run here for a stated reason (a drafter for another model, a missing file)."""


def count_errors(node) -> int:
    """Arms that failed anywhere inside a section's record."""
    if isinstance(node, dict):
        return int(node.get("status") == "error") + sum(count_errors(v) for v in node.values())
    return sum(count_errors(v) for v in node) if isinstance(node, list) else 0


def tail(lines: int = 12) -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-lines:])


# -- provenance -----------------------------------------------------------------------------------------------
def commit_of(given: str | None) -> tuple[str, str]:
    """(commit, where it came from): --commit, git, then .git's files read directly (a box without git)."""
    if given:
        return given, "--commit"
    commit, _ = git_state()
    if commit != "unknown":
        return commit, "git"
    head = ROOT / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            name = ref[5:]
            loose = ROOT / ".git" / name
            if loose.exists():
                return loose.read_text().strip(), ".git files"
            for line in (ROOT / ".git" / "packed-refs").read_text().splitlines():
                if line.endswith(" " + name):
                    return line.split()[0], ".git files"
        elif ref:
            return ref, ".git files"
    except OSError:
        pass
    return os.environ.get("KAKEYA_COMMIT", "unknown"), "KAKEYA_COMMIT" if os.environ.get("KAKEYA_COMMIT") else "unknown"


def cpu_info() -> dict:
    import torch

    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = value.split()
    except OSError:
        pass
    isa = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "asimd", "sve")
           if f in flags]
    return {"model": model, "isa_flags": isa, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cores": os.cpu_count(), "load_average_at_start": os.getloadavg()}


def device_info(device: str) -> dict:
    import torch

    out = {"requested": device, "kind": "gpu" if device.startswith("cuda") else "cpu-smoke"}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(device)
        out |= {"name": torch.cuda.get_device_name(device), "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version(), "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            out["nvidia_smi"] = smi.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            out["nvidia_smi"] = None
    else:
        out["name"] = "cpu"
    return out


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "grpcio", "protobuf", "numpy", "safetensors", "tokenizers", "gguf"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


# -- the model ------------------------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


def model_from_gguf(gguf: pathlib.Path, work: pathlib.Path, tokenizer_dir: pathlib.Path | None) -> tuple[pathlib.Path, dict]:
    """An HF directory converted from `gguf` by the model store's converter (dequantize, save, reload and
    check the logits: what `kakeya models pull` does), the GGUF kept beside it as source.gguf. Tokenizer
    files found in `tokenizer_dir` (default: the GGUF's own folder) replace the converted ones: some
    transformers versions drop the chat template and special tokens when reading a GGUF's tokenizer."""
    from inference_engine.model_store.convert import convert_gguf

    model_dir = work / "model"
    t = time.perf_counter()
    report = convert_gguf(gguf, model_dir, progress=False)
    info = {"source": "gguf", "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "converted_to": str(model_dir),
            "conversion_check_max_abs_logit_diff": report.max_abs_logit_diff,
            "converted_tokenizer_has_chat_template": report.tokenizer.chat_template}
    info["conversion_s"] = round(time.perf_counter() - t, 2)
    src = model_dir / "source.gguf"
    if not src.exists():
        try:
            src.symlink_to(gguf.resolve())
        except OSError:
            shutil.copy2(gguf, src)
    tokenizer_dir = tokenizer_dir or gguf.parent
    copied = [f for f in TOKENIZER_FILES if (tokenizer_dir / f).is_file() and tokenizer_dir.resolve() != model_dir.resolve()]
    for f in copied:
        shutil.copy2(tokenizer_dir / f, model_dir / f)
    info["tokenizer_files_from"] = {"dir": str(tokenizer_dir), "files": copied}
    meta = gguf.parent / "kakeya_model.json"
    name = json.loads(meta.read_text()).get("name", gguf.stem) if meta.exists() else gguf.stem
    (model_dir / "kakeya_model.json").write_text(json.dumps({"name": name, "converted_by": "scripts/gpu_check.py",
                                                            "source": {"gguf_file": gguf.name}}))
    return model_dir, info


class Prompts:
    """Token-id prompts. With a tokenizer that fits the model, chat-templated text (the runtime has no chat
    template: clients apply it, as the SDK's ChatHistory does); otherwise fixed pseudo-random ids (a tiny
    random-weight test model has no tokenizer and generates noise either way)."""

    def __init__(self, model_dir: pathlib.Path, vocab_size: int):
        self.vocab, self.tok, self.format = vocab_size, None, "synthetic ids (no tokenizer that fits the model)"
        if any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            if len(tok) <= vocab_size:
                self.tok = tok
                self.format = "chat template" if tok.chat_template else "plain 'User: ... Assistant:' text (no chat template)"

    def chat(self, message: str) -> list[int]:
        if self.tok is None:
            return self.synthetic(len(message) // 4 + 8, seed=sum(map(ord, message)))
        if self.tok.chat_template:
            text = self.tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False)
        else:
            text = f"User: {message}\nAssistant:"
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def synthetic(self, n: int, seed: int) -> list[int]:
        import random

        rng = random.Random(seed)
        return [rng.randrange(3, self.vocab) for _ in range(n)]

    def correctness(self, n: int) -> list[list[int]]:
        return [self.chat(m) for m in (*QUESTIONS[: max(0, n - 1)], EDIT_REQUEST)][-n:]

    def of_length(self, n: int, seed: int = 0) -> list[int]:
        """About-n-token prompt ending in the assistant's turn: a request padded with earlier text, kept to its last n."""
        if self.tok is None:
            return self.synthetic(n, seed)
        filler = " ".join(QUESTIONS[(seed + i) % len(QUESTIONS)] for i in range(4 * n // 10 + 4))
        ids = self.chat(f"{filler}\n\nNow answer this one: {QUESTIONS[seed % len(QUESTIONS)]}")
        return ids[-n:]

    def code_edit(self) -> list[int]:
        if self.tok is None:  # a block the answer can copy: what prompt lookup feeds on
            block = self.synthetic(40, seed=7)
            return self.synthetic(16, seed=8) + block * 3
        return self.chat(EDIT_REQUEST)


# -- the engine, as the daemon builds it ----------------------------------------------------------------------
def serve_config(args, **kw):
    from inference_engine.server.app import ServeConfig

    if "compile" in kw and not compile_supported():
        kw.pop("compile")  # a tree from before --compile: one engine kind, recorded as compile_supported false
    return ServeConfig(model=args.model_dir, device=args.device, weights="fp32", persist="off", capacity=64,
                       threads=args.threads, **kw)


def compile_supported() -> bool:
    from inference_engine.server.app import ServeConfig

    return "compile" in {f.name for f in dataclasses.fields(ServeConfig)}


class Models:
    """The daemon's model per --compile mode, each loaded by app.load_model (--compile is applied at load:
    the step's graphs belong to the model), on first use; the engines of a mode share its model."""

    def __init__(self, args):
        self.args, self.loaded, self.load_s = args, {}, {}

    def __call__(self, mode: str):
        if mode not in self.loaded:
            from inference_engine.server.app import load_model

            t = time.perf_counter()
            self.loaded[mode] = load_model(serve_config(self.args, compile=mode))
            self.load_s[mode] = round(time.perf_counter() - t, 2)
        return self.loaded[mode]

    def any(self):
        return next(iter(self.loaded.values())) if self.loaded else self(compile_modes()[0])

    def describe(self) -> dict:
        return {mode: {"load_s": self.load_s[mode], **step_kind(m)} for mode, m in self.loaded.items()}


def step_kind(model) -> dict:
    """How the model runs a step's dense work: eager pieces, CUDA graphs, or inductor-compiled segments."""
    return model.describe_step()


class Arm:
    """A Runtime built by app.build_runtime around the mode's model (what `kakeya serve` runs), and turns on it."""

    def __init__(self, args, models: Models, compile: str = "off", **kw):
        from inference_engine.server.app import build_runtime

        self.cfg = serve_config(args, compile=compile, **kw)
        model = models(compile)
        t = time.perf_counter()
        self.runtime = build_runtime(self.cfg, model)  # includes the daemon's warm-up
        self.build_s = round(time.perf_counter() - t, 3)
        engine = self.runtime.engine
        self.describe = {"kv": engine.strategy_info().as_dict(), "batching": engine.loop.batching, "compile": compile,
                         "build_s": self.build_s, **step_kind(model)}

    def turn(self, ids: list, n: int, *, keep=None) -> dict:
        """One session: its prompt, then n greedy tokens (eos ignored). keep(session) reads it before it closes."""
        from inference_engine.engine.events import GenerationDone, TokenGenerated
        from inference_engine.engine.requests import SamplingParams

        rt = self.runtime
        piece = self.cfg.max_append_tokens or len(ids) or 1  # a prompt longer than one call may carry goes in pieces
        s = rt.create_session(ids[:piece], ignore_eos=True)
        try:
            for a in range(piece, len(ids), piece):
                rt.append(s.id, ids[a:a + piece])
            toks, done = [], None
            for ev in rt.generate(s.id, n, SamplingParams()):
                if isinstance(ev, TokenGenerated):
                    toks.append(ev.token_id)
                elif isinstance(ev, GenerationDone):
                    done = ev
            extra = keep(s) if keep else {}
        finally:
            rt.close(s.id)
        decode_s = done.total_seconds - done.time_to_first_token_seconds
        return {"tokens": toks, "stop_reason": done.stop_reason, "decode_s": round(decode_s, 4), "drafted": done.drafted_tokens,
                "accepted": done.accepted_tokens,
                "decode_tok_s": (done.generated_tokens - 1) / decode_s if done.generated_tokens > 1 and decode_s > 0 else None,
                **extra}

    def decode_speed(self, ids: list, n: int, repeats: int) -> dict:
        self.turn(ids, min(n, 8))  # first turn of this arm: its one-time costs stay out of the timing
        runs = [self.turn(ids, n) for _ in range(repeats)]
        rates = [r["decode_tok_s"] for r in runs]
        return {"decode_tok_s": statistics.median(rates), "decode_tok_s_runs": [round(x, 2) for x in rates],
                "tokens": n, "prompt_tokens": len(ids), "identical_across_repeats": all(r["tokens"] == runs[0]["tokens"] for r in runs),
                "last": runs[-1]}

    def close(self) -> None:
        import torch

        del self.runtime
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def with_arm(args, models, fn, **kw):
    arm = Arm(args, models, **kw)
    try:
        return {"arm": arm.describe, **fn(arm)}
    finally:
        arm.close()


def compare(got: list, ref: list) -> dict:
    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if first is None and len(got) != len(ref):
        first = min(len(got), len(ref))
    return {"identical": got == ref, "first_divergence": first, "tokens": len(got), "reference_tokens": len(ref)}


def compile_modes() -> tuple:
    return ("off", "auto") if compile_supported() else ("off",)


# -- sections ---------------------------------------------------------------------------------------------------
def section_correctness(check, models, hf, prompts):
    sc = check.scale
    ids = prompts.correctness(sc.prompts)
    ref = [hf.generate(p, sc.correctness_tokens) for p in ids]
    out = {"prompts": len(ids), "tokens": sc.correctness_tokens, "prompt_tokens": [len(p) for p in ids],
           "reference": "transformers generate(do_sample=False), fp32, same device, eos ignored", "by_compile": {}}
    # --compile on (CUDA): inductor's kernels may order float sums differently; recorded, outside the target
    on = ("on",) if compile_supported() and check.args.device.startswith("cuda") else ()
    for mode in compile_modes() + on:
        def run(arm):
            rows = []
            for p, r in zip(ids, ref):
                got = arm.turn(p, sc.correctness_tokens)["tokens"]
                row = compare(got, r)
                if row["first_divergence"] is not None and row["first_divergence"] < min(len(got), len(r)):
                    # a near-tie (float order) or a real fault? transformers' own margin where they part
                    row["transformers_at_divergence"] = hf.margin(p + r[: row["first_divergence"]], got[row["first_divergence"]])
                rows.append(row)
            return {"per_prompt": rows, "all_identical": all(r["identical"] for r in rows)}

        out["by_compile"][mode] = check.arm(lambda run=run: with_arm(check.args, models, run, kv_strategy="full", compile=mode), 10)
    arms = [a for m, a in out["by_compile"].items() if m in compile_modes()]
    out["all_identical"] = all(a.get("all_identical") for a in arms) and all(a["status"] == "ok" for a in arms)
    if on:
        out["compile_on_identical"] = out["by_compile"]["on"].get("all_identical")
    return out


def drafter_skip_reason(name: str, model) -> str | None:
    if name == "ngram":
        return None
    from kv_cache_proposer import resolve_checkpoint

    try:
        path = resolve_checkpoint(name)
    except FileNotFoundError as e:
        return f"not on this machine: {e}"
    manifest = json.loads((path / "manifest.json").read_text())
    weights = path / manifest.get("weights", "drafter.safetensors")
    if not weights.is_file():
        return f"{weights} is missing"
    cfg, (vocab, hidden) = manifest.get("config", {}), model.embed.shape
    if cfg.get("vocab_size", vocab) != vocab or cfg.get("verifier_hidden_size", hidden) != hidden:
        return (f"trained for {cfg.get('verifier', 'another model')} (vocab {cfg.get('vocab_size')}, hidden "
                f"{cfg.get('verifier_hidden_size')}); this model has vocab {vocab}, hidden {hidden}")
    return None


def section_runs(check, models, prompts):
    sc, args = check.scale, check.args
    ids = prompts.of_length(sc.run_prompt, seed=1)
    mode = compile_modes()[-1]  # the daemon's default (auto) where the tree has it
    out = {"prompt_tokens": len(ids), "tokens": sc.run_tokens, "compile": mode, "kv": RUN_KV, "strategies": {}, "drafters": {}}
    plain = {}

    def keep(s):  # what the cache holds at the end: paged's page store and how often it recalled pages
        cache = s.kv.cache
        info = {"dropped_tokens": s.kv.dropped_total, "stored_bytes": int(getattr(cache, "stored_nbytes", 0))}
        timings = getattr(cache, "timings", None)
        if isinstance(timings, dict) and "recalls" in timings:
            info["page_recalls"] = timings["recalls"]
        return info

    from inference_engine.kv.registry import names as strategy_names  # built-in + research strategies

    for name in strategy_names():
        def run(arm):
            r = arm.turn(ids, sc.run_tokens, keep=keep)
            plain[arm.cfg.kv_strategy] = r["tokens"]
            return {k: v for k, v in r.items() if k != "tokens"} | {"generated": len(r["tokens"])}

        out["strategies"][name] = check.arm(
            lambda run=run, name=name: with_arm(args, models, run, kv_strategy=name, compile=mode, **RUN_KV))
    # With every page recalled, paged attends to the whole history: its tokens should be full's (up to the
    # float order of a two-part softmax; recorded, not required).
    out["paged_all_pages_vs_full"] = check.arm(lambda: with_arm(
        args, models, lambda arm: compare(arm.turn(ids, sc.run_tokens)["tokens"], plain["full"]) if "full" in plain else {},
        kv_strategy="paged", compile=mode, **(RUN_KV | {"recall_pages": 1024})))
    # The page shortlist (on by default past 256 candidate pages) forced on at this short history: its path runs on
    # this device; its tokens against exact choice's are recorded, not required (a shortlist may choose otherwise).
    def shortlisted(arm):
        r = arm.turn(ids, sc.run_tokens, keep=keep)
        same = {"identical_to_exact_choice": r["tokens"] == plain["paged"]} if "paged" in plain else {}
        return {k: v for k, v in r.items() if k != "tokens"} | {"generated": len(r["tokens"])} | same

    out["paged_shortlist"] = check.arm(lambda: with_arm(
        args, models, shortlisted, kv_strategy="paged", compile=mode, **(RUN_KV | {"page_shortlist": 2, "page_shortlist_from": 2})))
    for name in DRAFTERS:
        def run(arm):
            r = arm.turn(ids, sc.run_tokens)
            return {"generated": len(r["tokens"]), "drafted": r["drafted"], "accepted": r["accepted"],
                    "decode_tok_s": r["decode_tok_s"],
                    **({"identical_to_plain_full": r["tokens"] == plain["full"]} if "full" in plain else {})}

        reason = drafter_skip_reason(name, models.any())
        out["drafters"][name] = ({"status": "skipped", "reason": reason} if reason else
                                 check.arm(lambda run=run, name=name: with_arm(args, models, run, kv_strategy="full", drafter=name,
                                                                                spec_k=4, compile=mode)))
    return out


def section_decode_batch1(check, models, prompts):
    from inference_engine.kv.registry import names as strategy_names  # built-in + research strategies

    sc = check.scale
    ids = prompts.of_length(sc.speed_prompt)
    out = {"prompt_tokens": len(ids), "tokens": sc.speed_tokens, "repeats": sc.repeats, "kv": "ServeConfig defaults", "arms": {}}

    def run(arm):
        r = arm.decode_speed(ids, sc.speed_tokens, sc.repeats)
        r.pop("last")
        return r

    for name in strategy_names():
        for mode in compile_modes():
            out["arms"][f"{name}/compile={mode}"] = check.arm(
                lambda name=name, mode=mode: with_arm(check.args, models, run, kv_strategy=name, compile=mode), 8)
    # the same compile mode with the row graphs (backends/torch/row_graphs.py) off: the piecewise step they replace
    mode, rows_gain = compile_modes()[-1], {}
    for name in ("full", "sink_window"):
        def piecewise(name=name):
            model = models(mode)
            graphs = getattr(model, "row_graphs", None)
            if graphs is None:
                raise Skip("this model runs no row graphs (they are on with --compile auto/on on CUDA)")
            model.row_graphs = None  # caches built now keep their own slabs; every step runs piecewise
            try:
                return with_arm(check.args, models, run, kv_strategy=name, compile=mode)
            finally:
                model.row_graphs = graphs

        arm = out["arms"][f"{name}/compile={mode}/row_graphs=off"] = check.arm(piecewise, 8)
        full = out["arms"].get(f"{name}/compile={mode}", {})
        if arm.get("decode_tok_s") and full.get("decode_tok_s"):
            rows_gain[name] = round(full["decode_tok_s"] / arm["decode_tok_s"], 3)
    # auto on CUDA runs the row graphs through inductor (where triton is): the same arms with eager pieces instead
    fused_gain = {}
    for name in ("full", "sink_window"):
        def eager_pieces(name=name):
            from inference_engine.backends.torch.graphs import Segments

            graphs = getattr(models(mode), "row_graphs", None)
            if graphs is None or not graphs.fns.compiled:
                raise Skip("this model's row graphs run no inductor kernels (CUDA with triton, --compile auto/on)")
            saved = graphs.fns, graphs._graphs
            graphs.fns, graphs._graphs = Segments(False), {}
            try:
                return with_arm(check.args, models, run, kv_strategy=name, compile=mode)
            finally:
                graphs.fns, graphs._graphs = saved

        arm = out["arms"][f"{name}/compile={mode}/inductor=off"] = check.arm(eager_pieces, 8)
        fused = out["arms"].get(f"{name}/compile={mode}", {})
        if arm.get("decode_tok_s") and fused.get("decode_tok_s"):
            fused_gain[name] = round(fused["decode_tok_s"] / arm["decode_tok_s"], 3)
    out["inductor_over_eager_pieces"] = fused_gain
    # --compile on (CUDA): the row graphs' dense work as inductor's fused kernels, inside the same capture
    on_gain = {}
    for name in ("full", "sink_window"):
        def compiled(name=name):
            if not (compile_supported() and check.args.device.startswith("cuda")):
                raise Skip("--compile on is measured on CUDA only (on the CPU it is inductor's C++ segments, minutes "
                           "of compile, and no faster: results/research/compile_cpu.json)")
            return with_arm(check.args, models, run, kv_strategy=name, compile="on")

        arm = out["arms"][f"{name}/compile=on"] = check.arm(compiled, 30)
        auto = out["arms"].get(f"{name}/compile={mode}", {})
        if arm.get("decode_tok_s") and auto.get("decode_tok_s"):
            on_gain[name] = round(arm["decode_tok_s"] / auto["decode_tok_s"], 3)
    out["compile_on_over_auto"] = on_gain
    gains = {}
    for name in strategy_names():
        off, auto = out["arms"].get(f"{name}/compile=off", {}), out["arms"].get(f"{name}/compile=auto", {})
        if off.get("decode_tok_s") and auto.get("decode_tok_s"):
            gains[name] = round(auto["decode_tok_s"] / off["decode_tok_s"], 3)
    out["compile_auto_over_off"] = gains
    out["row_graphs_over_piecewise"] = rows_gain
    return out


def section_profile(check, models, prompts):
    """Where one batch-1 decode token's time goes, for `full` (row graphs on CUDA) and `paged` (piecewise), at the
    fastest compile mode: torch.profiler over a turn of n tokens and over a turn of 1 (same prompt); the difference
    over n - 1 is one decode token (bench_engine's rule), so the prompt's prefill drops out. Per token: wall, host
    ops dispatched, their self CPU time, device (kernel) time, and the top ops by each. Then a chrome trace (gzip)
    of a few `full` tokens with Python stacks, next to --out, for a person to open."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sc, args = check.scale, check.args
    ids, n = prompts.of_length(sc.speed_prompt), min(sc.speed_tokens, 32)  # the profiler's tables cost per kernel
    mode = compile_modes()[-1]
    cuda = args.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {"prompt_tokens": len(ids), "tokens": n, "compile": mode, "activities": [str(a) for a in acts],
           "rule": "(profile of a turn of n tokens - profile of a turn of 1) / (n - 1)", "arms": {}}

    def table(prof) -> dict:
        rows = {}
        for e in prof.key_averages():
            dev = getattr(e, "self_device_time_total", None)
            if dev is None:
                dev = getattr(e, "self_cuda_time_total", 0)
            on_device = "CUDA" in str(getattr(e, "device_type", "")) or (dev and not e.self_cpu_time_total and e.count)
            rows[e.key] = (e.count, float(e.self_cpu_time_total), float(dev or 0), bool(on_device))
        return rows

    def per_token(long, short) -> dict:
        d = {k: ((v[0] - short.get(k, (0, 0, 0, 0))[0]) / (n - 1), (v[1] - short.get(k, (0, 0, 0, 0))[1]) / (n - 1),
                 (v[2] - short.get(k, (0, 0, 0, 0))[2]) / (n - 1), v[3]) for k, v in long.items()}
        host = {k: v for k, v in d.items() if not v[3]}
        kernels = {k: v for k, v in d.items() if v[3]}

        def top(rows, col, m):
            best = sorted(rows.items(), key=lambda kv: -kv[1][col])[:m]
            return [{"op": k[:120], "calls": round(v[0], 2), "self_cpu_us": round(v[1], 2), "device_us": round(v[2], 2)}
                    for k, v in best if v[col] > 0]

        return {"host_ops": round(sum(v[0] for v in host.values()), 1),
                "host_self_cpu_ms": round(sum(v[1] for v in host.values()) / 1e3, 4),
                "device_kernels": round(sum(v[0] for v in kernels.values()), 1),
                "device_kernel_ms": round(sum(v[2] for v in kernels.values()) / 1e3, 4),
                "top_host_ops_by_self_cpu": top(host, 1, 15), "top_kernels_by_device_time": top(kernels, 2, 10)}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def profiled(arm, prof, fn) -> None:
        """fn (a turn, from this thread as the servicer's threads call) under prof, which is started and stopped
        on the thread that runs the engine loop: the profiler records the ops of the thread that starts it."""
        mt = arm.runtime.engine.loop.model_thread
        on_loop = mt.call if mt is not None else (lambda f: f())
        on_loop(prof.__enter__)
        try:
            fn()
        finally:
            on_loop(lambda: (sync(), prof.__exit__(None, None, None)))

    def measure(arm) -> dict:
        arm.turn(ids, n)  # warm: graphs recorded, buffers made
        profs, walls = [], []
        for k in (n, 1):
            sync()
            prof = profile(activities=acts)
            profiled(arm, prof, lambda k=k: walls.append(arm.turn(ids, k)))
            profs.append(table(prof))
        long, short = walls
        res = per_token(*profs)
        res["wall_ms_per_token"] = round(1e3 * long["decode_s"] / max(1, n - 1), 4)  # the engine's own decode clock
        res["unprofiled_decode_tok_s"] = round(arm.turn(ids, n)["decode_tok_s"] or 0, 2)
        return res

    arms = [("full", mode), ("paged", mode)] + ([("full", "on")] if compile_supported() and cuda else [])
    for name, m in arms:
        out["arms"][f"{name}/compile={m}"] = check.arm(
            lambda name=name, m=m: with_arm(args, models, measure, kv_strategy=name, compile=m), 10)

    def trace(arm) -> dict:
        k = min(n, 8)
        arm.turn(ids, k)
        prof = profile(activities=acts, with_stack=True)
        profiled(arm, prof, lambda: arm.turn(ids, k))
        raw = pathlib.Path(args.out).with_name(pathlib.Path(args.out).stem + f"_trace_full_{k}tok.json")
        prof.export_chrome_trace(str(raw))
        import gzip

        gz = raw.with_name(raw.name + ".gz")
        with open(raw, "rb") as f, gzip.open(gz, "wb", compresslevel=6) as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
        return {"trace": gz.name, "tokens": k, "bytes": gz.stat().st_size, "with_stack": True}

    out["trace"] = check.arm(lambda: with_arm(args, models, trace, kv_strategy="full", compile=mode), 10)
    return out


def section_aggregate(check, models, prompts):
    sc = check.scale
    levels = [int(x) for x in check.args.levels.split(",")]
    mode = compile_modes()[-1]

    def run(arm):
        res = {}
        for n in levels:
            res[str(n)] = check.arm(lambda n=n: aggregate_level(arm, prompts, n, sc), 8)
        return {"levels": res}

    out = with_arm(check.args, models, run, batching="on", compile=mode)
    out |= {"prompt_tokens": sc.speed_prompt, "tokens_per_session": sc.speed_tokens}
    return out


def aggregate_level(arm, prompts, n, sc) -> dict:
    """n sessions, each prefilled (a short first turn), then all decode sc.speed_tokens at once on their own
    threads; aggregate decode tok/s = tokens / time until the last stream ends (bench_load's pure decode)."""
    def once(tokens):
        start, ends, errors = threading.Barrier(n + 1), [None] * n, []

        def one(i):
            from inference_engine.engine.events import TokenGenerated
            from inference_engine.engine.requests import SamplingParams

            rt = arm.runtime
            try:
                s = rt.create_session(prompts.of_length(sc.speed_prompt, seed=i), ignore_eos=True)
                list(rt.generate(s.id, 1, SamplingParams()))  # prefilled: what follows is decode only
                start.wait(timeout=600)
                got = sum(isinstance(ev, TokenGenerated) for ev in rt.generate(s.id, tokens, SamplingParams()))
                ends[i] = (time.perf_counter(), got)
                rt.close(s.id)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
                start.abort()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        try:
            start.wait(timeout=600)
        except threading.BrokenBarrierError:
            pass
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"{len(errors)} of {n} sessions failed: {errors[:3]}")
        done = [e for e in ends if e is not None]
        toks = sum(k for _, k in done)
        wall = max(t for t, _ in done) - t0
        return {"sessions": n, "tokens": toks, "wall_s": round(wall, 4), "aggregate_decode_tok_s": toks / wall}

    once(min(8, sc.speed_tokens))  # warm: this batch size's first forwards (and any capture) stay out of the timing
    stats = arm.runtime.engine.loop.stats
    forwards0, steps0 = stats.forwards, stats.steps
    r = once(sc.speed_tokens)
    r["mean_steps_per_forward"] = round((stats.steps - steps0) / max(1, stats.forwards - forwards0), 2)
    return r


def section_ngram(check, models, prompts):
    sc = check.scale
    ids = prompts.code_edit()
    mode = compile_modes()[-1]
    plain, spec = Arm(check.args, models, kv_strategy="full", compile=mode), None
    try:
        spec = Arm(check.args, models, kv_strategy="full", drafter="ngram", spec_k=4, compile=mode)
        plain.turn(ids, min(8, sc.speed_tokens))
        spec.turn(ids, min(8, sc.speed_tokens))
        p_runs, s_runs = [], []
        for _ in range(sc.repeats):  # interleaved: a drifting machine moves both arms alike
            p_runs.append(plain.turn(ids, sc.speed_tokens))
            s_runs.append(spec.turn(ids, sc.speed_tokens))
    finally:
        plain.close()
        if spec is not None:
            spec.close()
    p = statistics.median(r["decode_tok_s"] for r in p_runs)
    s = statistics.median(r["decode_tok_s"] for r in s_runs)
    drafted, accepted = sum(r["drafted"] for r in s_runs), sum(r["accepted"] for r in s_runs)
    return {"prompt": "code edit (chat-templated)" if prompts.tok else "synthetic ids with a repeated block", "prompt_tokens": len(ids),
            "tokens": sc.speed_tokens, "k": 4, "compile": mode, "plain_decode_tok_s": p, "ngram_decode_tok_s": s,
            "speedup": round(s / p, 3), "acceptance": round(accepted / drafted, 3) if drafted else None,
            "identical_to_plain": all(a["tokens"] == b["tokens"] for a, b in zip(p_runs, s_runs))}


def section_paged_long(check, models, prompts):
    """paged with the daemon's defaults (quick: RUN_KV's small layout) at a short history, at the trained context
    and past it: one session per length, its prompt prefilled (time to first token), then long_tokens decoded."""
    sc = check.scale
    mode = compile_modes()[-1]
    ctx = models.any().spec.max_context
    short, *multiples = sc.long_context
    lengths = [int(short)] + [int(m * ctx) for m in multiples]
    # quick: calls of at most 1024 tokens, so the longest prompt goes in pieces as a 32k one does at the defaults
    kv = RUN_KV | {"max_append_tokens": 1024} if check.args.quick else {}

    def run(arm):
        res = {}
        for n in lengths:
            def one(n=n):
                t = time.perf_counter()
                r = arm.turn(prompts.of_length(n, seed=5), sc.long_tokens)
                return {"prompt_tokens": n, "seconds": round(time.perf_counter() - t, 2), "decode_tok_s": r["decode_tok_s"],
                        "stop_reason": r["stop_reason"], "generated": len(r["tokens"])}

            res[str(n)] = check.arm(one, 10)
            check.doc["sections"]["paged_long"]["lengths"] = res  # a run cut short in a longer one keeps the shorter
            check.write()
            print(f"[{time.perf_counter() - check.t0:6.1f}s] paged_long {n} tokens: {res[str(n)]['status']}", flush=True)
        return {"lengths": res}

    out = with_arm(check.args, models, run, kv_strategy="paged", compile=mode, **kv)
    rates = {n: v.get("decode_tok_s") for n, v in out.get("lengths", {}).items()}
    base = rates.get(str(lengths[0]))
    out |= {"max_context": ctx, "decode_vs_short": {n: round(v / base, 3) if v and base else None for n, v in rates.items()}}
    return out


# -- transformers, the controls --------------------------------------------------------------------------------
class HF:
    """transformers' own model and generate on the same device, run on the daemon's model thread (its thread pool)."""

    def __init__(self, model_dir: str, device: str):
        import torch
        from transformers import AutoModelForCausalLM

        from inference_engine.server.app import model_thread

        self.mt, self.device, self.torch = model_thread(), device, torch
        self.model = self.mt.call(lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval())
        self.attn = getattr(self.model.config, "_attn_implementation", None)

    def generate(self, ids: list, n: int, **kw) -> list:
        torch = self.torch

        def run():
            x = torch.tensor([ids], device=self.device)
            with torch.inference_mode():
                out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                          eos_token_id=None, pad_token_id=0, **kw)
            return out[0, len(ids):].tolist()  # .tolist() waits for the device

        return self.mt.call(run)

    def decode_speed(self, ids: list, n: int, repeats: int, **kw) -> dict:
        return decode_speed(lambda k: self.generate(ids, k, **kw), n, repeats)

    def margin(self, ids: list, other: int) -> dict:
        """transformers' next-token logits after `ids`: its top two and the logit of `other` (the engine's pick)."""
        torch = self.torch

        def run():
            with torch.inference_mode():
                logits = self.model(torch.tensor([ids], device=self.device)).logits[0, -1].float()
            top = torch.topk(logits, 2)
            return {"top2": top.indices.tolist(), "top2_logits": [round(x, 5) for x in top.values.tolist()],
                    "engine_token_logit": round(float(logits[other]), 5),
                    "gap_to_engine_token": round(float(top.values[0] - logits[other]), 5)}

        return self.mt.call(run)

    def close(self) -> None:
        self.model = None
        gc.collect()
        if self.torch.cuda.is_available():
            self.torch.cuda.empty_cache()


def decode_speed(gen, n: int, repeats: int) -> dict:
    """Decode tok/s of a generate call: (n - 1) / (time of n tokens - time of 1 token), bench_engine's rule."""
    gen(n)  # warm (a compiled arm compiles and records here)
    gen(n)
    rates, tokens = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        gen(1)
        first = time.perf_counter() - t
        t = time.perf_counter()
        tokens = gen(n)
        total = time.perf_counter() - t
        rates.append((n - 1) / max(1e-9, total - first))
    return {"decode_tok_s": statistics.median(rates), "decode_tok_s_runs": [round(x, 2) for x in rates], "tokens": n,
            "generated": len(tokens), "output": tokens}


def section_transformers_eager(check, hf, prompts):
    sc = check.scale
    ids = prompts.of_length(sc.speed_prompt)
    r = hf.decode_speed(ids, sc.speed_tokens, sc.repeats)
    check.eager_output = r.pop("output")
    return r | {"prompt_tokens": len(ids), "attn_implementation": hf.attn, "cache": "dynamic (default)", "compiled": False}


def section_transformers_compiled(check, prompts):
    args, sc = check.args, check.scale
    if args.hf_compile == "off" or (args.hf_compile == "auto" and args.device == "cpu"):
        raise Skip("--hf-compile off" if args.hf_compile == "off" else
                     "skipped on cpu (--hf-compile auto): a CPU compile costs minutes and measures nothing about GPUs; "
                     "--hf-compile on forces it")
    ids = prompts.of_length(sc.speed_prompt)
    left = check.left() - check.reserved_after("transformers_static_compiled") - 10 * sc.reserve
    timeout = max(1.0, min(args.hf_compile_timeout_s, left))
    with tempfile.TemporaryDirectory(prefix="gpu-check-hf-") as tmp:
        job, res = pathlib.Path(tmp) / "job.json", pathlib.Path(tmp) / "result.json"
        job.write_text(json.dumps({"model_dir": args.model_dir, "device": args.device, "ids": ids, "tokens": sc.speed_tokens,
                                   "repeats": sc.repeats, "result": str(res)}))
        proc = subprocess.Popen([sys.executable, __file__, "--hf-worker", str(job)], start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the compile's worker processes with it
            proc.communicate()
            raise Budget(f"timeout: transformers static cache + torch.compile did not finish in {timeout:.0f} s") from None
        if proc.returncode != 0 or not res.exists():
            raise RuntimeError(f"the transformers worker exited {proc.returncode}: {log[-2000:]}")
        r = json.loads(res.read_text())
    out = r.pop("output")
    eager = check.eager_output
    if eager is not None:
        r["identical_to_eager"] = out == eager
    return r | {"prompt_tokens": len(ids), "timeout_s": round(timeout)}


def hf_worker(job_path: str) -> int:
    """The compiled control in its own process: static cache, generate's own torch.compile of the forward
    (transformers' documented way: CompileConfig, mode reduce-overhead = CUDA graphs)."""
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig

    job = json.loads(pathlib.Path(job_path).read_text())
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32).to(job["device"]).eval()
    config = CompileConfig(mode="reduce-overhead")
    if job["device"] == "cpu":
        config._compile_all_devices = True  # generate compiles on accelerators only unless told
    ids = job["ids"]

    def gen(n):
        x = torch.tensor([ids], device=job["device"])
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, cache_implementation="static", compile_config=config)
        return out[0, len(ids):].tolist()

    t_load = time.perf_counter() - t
    t = time.perf_counter()
    gen(job["tokens"])
    first_call_s = time.perf_counter() - t
    r = decode_speed(gen, job["tokens"], job["repeats"])
    r |= {"load_s": round(t_load, 2), "first_call_s_with_compile": round(first_call_s, 2), "cache": "static",
          "compile": "generate's auto-compile, CompileConfig(mode='reduce-overhead')",
          "compiled": hasattr(model, "_compiled_call"), "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    pathlib.Path(job["result"]).write_text(json.dumps(r))
    return 0


# -- ratios and targets ----------------------------------------------------------------------------------------
def ratios_and_targets(doc: dict) -> None:
    s = doc["sections"]
    mode = "auto" if doc["compile_supported"] else "off"
    b1 = s.get("decode_batch1", {}).get("arms", {}).get(f"full/compile={mode}", {}).get("decode_tok_s")
    eager = s.get("transformers_eager", {}).get("decode_tok_s")
    compiled = s.get("transformers_static_compiled", {}).get("decode_tok_s")
    levels = s.get("aggregate", {}).get("levels", {})
    agg = {n: lv.get("aggregate_decode_tok_s") for n, lv in levels.items()}

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    r = {"engine_arm": f"full/compile={mode}", "batch1_vs_transformers_eager": ratio(b1, eager),
         "batch1_vs_transformers_static_compiled": ratio(b1, compiled),
         "aggregate_vs_1_session": {n: ratio(v, agg.get("1")) for n, v in agg.items()},
         "ngram_k4_speedup": s.get("ngram", {}).get("speedup"),
         "compile_auto_over_off": s.get("decode_batch1", {}).get("compile_auto_over_off"),
         "row_graphs_over_piecewise": s.get("decode_batch1", {}).get("row_graphs_over_piecewise"),
         "compile_on_over_auto": s.get("decode_batch1", {}).get("compile_on_over_auto"),
         "inductor_over_eager_pieces": s.get("decode_batch1", {}).get("inductor_over_eager_pieces")}
    doc["ratios"] = r
    runs = s.get("runs", {})
    paged = runs.get("strategies", {}).get("paged", {})
    corr = s.get("correctness", {})

    def gate(value, ok, target):
        return {"target": target, "value": value, "met": None if value is None else bool(ok)}

    x16 = r["aggregate_vs_1_session"].get("16")
    long_lengths = s.get("paged_long", {}).get("lengths", {})
    ctx = s.get("paged_long", {}).get("max_context") or doc.get("model", {}).get("max_context")
    past = [n for n in long_lengths if ctx and int(n) > ctx]  # lengths past the trained context (a cut run may have none)
    longest = long_lengths[max(past, key=int)] if past else {}
    r["paged_long_decode_vs_short"] = s.get("paged_long", {}).get("decode_vs_short")
    every = [a for group in ("strategies", "drafters") for a in runs.get(group, {}).values()]
    doc["targets"] = {
        "applies": doc["device"]["kind"] == "gpu",  # the targets are GPU targets: a cpu-smoke run only exercises them
        "correctness_full_identical_to_transformers": gate(corr.get("all_identical"), corr.get("all_identical"),
                                                           "every prompt, compile off and auto"),
        "batch1_ge_3x_transformers_static_compiled": gate(r["batch1_vs_transformers_static_compiled"],
                                                          (r["batch1_vs_transformers_static_compiled"] or 0) >= 3, ">= 3"),
        "aggregate16_ge_8x_batch1": gate(x16, (x16 or 0) >= 8, ">= 8"),
        "paged_runs_and_recalls": gate(paged.get("status"),
                                       paged.get("status") == "ok" and (paged.get("page_recalls") or paged.get("stored_bytes") or 0) > 0,
                                       "status ok with pages stored and recalled"),
        "paged_past_the_context_runs": gate(
            longest.get("status"), longest.get("status") == "ok" and longest.get("generated", 0) > 0,
            "paged decodes at 4x the trained context (quick: just past it)"),
        "every_strategy_and_drafter_runs": gate(
            [a["status"] for a in every] or None, every and all(a["status"] in ("ok", "skipped") for a in every),
            "ok (a drafter absent or made for another model is skipped, with its reason)"),
    }


# -- main -------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="HF model directory (config.json + safetensors; tokenizer files for chat prompts)")
    src.add_argument("--gguf", help="a GGUF file: converted to an HF directory under --work-dir first (needs the gguf package)")
    ap.add_argument("--work-dir", help="where --gguf is converted (default: a temporary directory, removed at the end)")
    ap.add_argument("--tokenizer-dir", help="--gguf: copy tokenizer files from here (default: the GGUF's folder, when it has them)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for the smoke run")
    ap.add_argument("--quick", action="store_true", help="everything scaled down (the test suite's CPU run: well under a minute)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget; a section without enough left is skipped")
    ap.add_argument("--commit", help="the commit this tree is (a box without .git); default: git, then .git's files")
    ap.add_argument("--threads", type=int, default=None, help="--threads of the engines (default: torch's choice)")
    ap.add_argument("--levels", default="1,4,16", help="concurrent sessions of the aggregate section")
    ap.add_argument("--hf-compile", choices=("auto", "on", "off"), default="auto",
                    help="transformers static cache + torch.compile control (auto: on CUDA only)")
    ap.add_argument("--hf-compile-timeout-s", type=float, default=240.0)
    ap.add_argument("--long-context", default="", metavar="TOKENS,MULT,...",
                    help="paged_long's lengths: a short baseline in tokens, then multiples of the trained context "
                         "(default 1024,1,4; e.g. 1024,2 for one rung at 16k that fits a shorter call)")
    ap.add_argument("--sections", default="", help=f"comma list to run only these ({', '.join(SECTIONS)}); default all")
    ap.add_argument("--hf-worker", help=argparse.SUPPRESS)
    ap.add_argument("--summarize", metavar="JSON",
                    help="a run's JSON that its time limit cut short: mark the section it was in, compute the ratios and "
                         "targets from the sections it finished, and write the result to --out (runs nothing)")
    args = ap.parse_args(argv)
    args.sections = [x for x in args.sections.split(",") if x]
    if args.hf_worker or args.summarize:
        return args
    if not (args.model_dir or args.gguf):
        ap.error("pass --model-dir DIR or --gguf FILE")
    if args.device == "cpu" and pathlib.Path(args.out).resolve() == DEFAULT_OUT.resolve():
        ap.error(f"a CPU run writes no GPU figures: pass --out elsewhere than {DEFAULT_OUT.relative_to(ROOT)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hf_worker:
        return hf_worker(args.hf_worker)
    if args.summarize:
        return summarize_cut_run(args)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    commit, commit_source = commit_of(args.commit)
    _, dirty = git_state()
    device = device_info(args.device)
    doc = {"label": "gpu" if device["kind"] == "gpu" else "cpu-smoke: not GPU figures",
           "command": command_line(), "commit": commit, "commit_source": commit_source, "dirty_worktree": dirty,
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device, "cpu": cpu_info(),
           "versions": versions(), "config": {k: v for k, v in vars(args).items() if k != "hf_worker"},
           "scale": dataclasses.asdict(QUICK if args.quick else FULL), "compile_supported": compile_supported(),
           "complete": False, "sections": {}}
    check = Check(args, doc)
    doc["scale"] = dataclasses.asdict(check.scale)  # --long-context included
    check.write()
    work = None
    try:
        if args.gguf:
            work = pathlib.Path(args.work_dir) if args.work_dir else pathlib.Path(tempfile.mkdtemp(prefix="gpu-check-"))
            model_dir, doc["model"] = model_from_gguf(pathlib.Path(args.gguf), work,
                                                      pathlib.Path(args.tokenizer_dir) if args.tokenizer_dir else None)
            args.model_dir = str(model_dir)
        else:
            doc["model"] = {"source": "hf-dir", "dir": str(pathlib.Path(args.model_dir).resolve())}
        run_all(check, args)
    except Exception as e:  # noqa: BLE001 - the model never loaded: still a record of why
        doc["error"] = f"{type(e).__name__}: {e}"
        doc["traceback"] = tail(20)
        print(doc["traceback"], file=sys.stderr)
    finally:
        if work is not None and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    ratios_and_targets(doc)
    doc["complete"] = "error" not in doc
    doc["within_8_minutes"] = time.perf_counter() - T_START <= 480  # the limit for the whole run
    doc["cpu"]["load_average_at_end"] = os.getloadavg()
    check.write()
    print(json.dumps({"label": doc["label"], "device": device.get("name"), "ratios": doc["ratios"],
                      "targets": {k: (v["met"] if isinstance(v, dict) else v) for k, v in doc["targets"].items()},
                      "sections": {k: v.get("status") for k, v in doc["sections"].items()}}, indent=1))
    print(f"wrote {args.out}")
    return 0 if doc["complete"] else 1


def summarize_cut_run(args) -> int:
    """--summarize: a run killed by its time limit wrote every finished section (and the finished arms of the
    one it was in, where the section records them as it goes) but no ratios or targets: add them from those."""
    doc = json.loads(pathlib.Path(args.summarize).read_text())
    if "ratios" in doc:
        print(f"{args.summarize} is a finished run: it has its ratios already", file=sys.stderr)
        return 2
    cut = [name for name, sec in doc["sections"].items() if sec.get("status") == "running"]
    for name in cut:
        doc["sections"][name].update(status="cut", reason="the run's time limit ended it inside this section; "
                                                          "what it had finished is kept")
    ratios_and_targets(doc)
    doc["summarized"] = {"command": "scripts/gpu_check.py " + " ".join(sys.argv[1:] if sys.argv[1:] else []),
                         "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cut_sections": cut,
                         "note": "ratios and targets computed after the run from the sections it finished"}
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(json.dumps({"ratios": doc["ratios"], "targets": {k: (v["met"] if isinstance(v, dict) else v)
                                                           for k, v in doc["targets"].items()}, "cut": cut}, indent=1))
    print(f"wrote {out}")
    return 0


def run_all(check: Check, args) -> None:
    from inference_engine.server.app import ServeConfig

    doc = check.doc
    t = time.perf_counter()
    models = Models(args)
    model = models(compile_modes()[0])
    hf = HF(args.model_dir, args.device)
    from inference_engine.engine.model_thread import isolate_other_threads

    isolate_other_threads()  # as app.start does: this thread and the session threads run small ops single-threaded
    prompts = Prompts(pathlib.Path(args.model_dir), model.spec.vocab_size)
    s = model.spec
    doc["model"] |= {"model_id": model.model_id, "model_type": s.model_type, "vocab_size": s.vocab_size, "layers": s.num_layers,
                     "max_context": s.max_context,
                     "hidden_size": s.hidden_size, "weights": model.weights_format, "prompt_format": prompts.format,
                     "load_s": round(time.perf_counter() - t, 2), "daemon_defaults": {
                         k: getattr(ServeConfig(), k) for k in ("kv_strategy", "sink", "page_size", "recall_pages", "batching")}
                         | {"window": ServeConfig().resolved_window, "paged_window": ServeConfig(kv_strategy="paged").resolved_window}}
    doc["model"]["by_compile"] = models.describe()
    check.write()
    steps = {"correctness": lambda: section_correctness(check, models, hf, prompts),
             "runs": lambda: section_runs(check, models, prompts),
             "decode_batch1": lambda: section_decode_batch1(check, models, prompts),
             "profile": lambda: section_profile(check, models, prompts),
             "transformers_eager": lambda: section_transformers_eager(check, hf, prompts),
             "transformers_static_compiled": lambda: section_transformers_compiled(check, prompts),
             "aggregate": lambda: section_aggregate(check, models, prompts),
             "ngram": lambda: section_ngram(check, models, prompts),
             "paged_long": lambda: section_paged_long(check, models, prompts)}
    for name in SECTIONS:
        if name == "transformers_static_compiled":
            hf.close()  # its memory back before the compiled control loads its own copy
        check.section(name, steps[name])
    doc["model"]["by_compile"] = models.describe()  # the graphs each mode's model made over the run


if __name__ == "__main__":
    sys.exit(main())
