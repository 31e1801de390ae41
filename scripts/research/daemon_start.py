"""How long `kakeya serve` takes to say READY, and where the time goes: the daemon started as a user starts it
(a subprocess, its defaults, the model from the store), --rounds times per arm, the arms interleaved round by round:

  kept      the files a daemon keeps next to the model are there (what every start after the first finds);
  made      the native step's head blocks (`.kakeya-native-head-<weights>-<tag>.safetensors`, native.head_blocks) are
            removed before the start, so the daemon makes them again (and writes them);
  packed    the native step's layer blocks (`.kakeya-native-layers-<weights>-<tag>.safetensors`, native.layer_blocks)
            are removed before the start, so the daemon packs the layers' int4 linears again (and writes them);
  measured  `--compile auto`'s kept measurement (`.kakeya-compile-auto-<weights>.json`, native.keep_verdict) is
            removed, so the daemon times the native step against the Python pieces again (and keeps the result);
  before    all three removed: every start before they were kept;
  transformers  both kept, the weights read through transformers (`--loader transformers`: every start before
            backends/torch/checkpoint.py; the default `--loader auto` reads them with safetensors where it can);
  fallback  both kept, the quantized linears' torch copies kept too (TorchCausalLM.defer_fallback patched to a no-op
            in the daemon's process: every start before it kept them beside the native step's own copies).

Per start: seconds from the process's launch to its READY line, its resident memory then (VmRSS), and the phases its
log stamps (the process start to the weights read (imports, config, weights), the native step's load, the native
step's packing, the `--compile auto` measurement, the warm-up forward and the start-up objects' freeze, up to
serving). Medians per arm, and each arm's over kept's.

    python scripts/research/daemon_start.py --rounds 5 --threads 2 --out results/research/daemon_start_avx2.json
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_common import ROOT, run_metadata, write_json  # noqa: E402

# the daemon's log lines that close each phase (server/app.py, backends/torch/native.py), in order
PHASES = (("imports_and_weights", "read through "), ("native_load", "native CPU row step loaded"),
          ("native_packing", "native step: "),
          ("compile_auto", "--compile auto"), ("warm_up", "warm-up forward"), ("freeze", "froze "),
          ("serving", "kakeya serving"))
# the fallback arm: `kakeya serve` with TorchCausalLM.defer_fallback made a no-op (the torch copies of the quantized
# linears kept, as every start before it), patched in the daemon's own process; no flag of the product does this
KEEP_FALLBACK = ("import sys\n"
                 "from inference_engine.backends.torch.model import TorchCausalLM\n"
                 "TorchCausalLM.defer_fallback = lambda self: False\n"
                 "from inference_engine.server.cli import main\n"
                 "sys.exit(main(sys.argv[1:]))\n")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def resident_mb(pid: int) -> float | None:
    """The process's resident memory (VmRSS) in MB, where /proc has it."""
    try:
        for text in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if text.startswith("VmRSS:"):
                return round(int(text.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def start_once(args, model_dir: pathlib.Path, arm: str, work: pathlib.Path) -> dict:
    removed = {"made": ["native-head"], "packed": ["native-layers"], "measured": ["compile-auto"],
               "before": ["native-head", "native-layers", "compile-auto"]}
    for name in removed.get(arm, []):
        for f in [*model_dir.glob(f".kakeya-{name}-{args.weights}.*"), *model_dir.glob(f".kakeya-{name}-{args.weights}-*")]:
            f.unlink()
    log = work / f"{arm}-{time.time_ns()}.log"
    launch = ["-m", "inference_engine.server.cli"] if arm != "fallback" else ["-c", KEEP_FALLBACK]
    cmd = [sys.executable, *launch, "serve", "--model", args.model, "--bind", "127.0.0.1:0",
           "--threads", str(args.threads), "--weights", args.weights, "--persist", "off"]
    if arm == "transformers":
        cmd += ["--loader", "transformers"]
    launched = time.time()
    t0 = time.perf_counter()
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        line = proc.stdout.readline()
        ready = time.perf_counter() - t0
        rss = resident_mb(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:  # it did not stop: every thread's stack into its log (faulthandler), then say so
            proc.send_signal(signal.SIGUSR1)
            try:
                proc.wait(timeout=5)  # the dump is written in the handler; the daemon does not exit on SIGUSR1
            except subprocess.TimeoutExpired:
                pass
            proc.kill()
            proc.wait()
            tail = log.read_text(errors="replace")[-6000:]
            raise SystemExit(f"{arm}: the daemon did not exit within 120 s of SIGTERM (READY line {line!r}); its log's "
                             f"end, with every thread's stack:\n{tail}") from None
    if not line.startswith("READY"):
        raise SystemExit(f"{arm}: the daemon did not start ({line!r}); see {log}")
    stamps, prev = {}, launched
    logged = log.read_text(errors="replace")
    for text in logged.splitlines():
        m = STAMP.match(text)
        if not m:
            continue
        t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for name, marker in PHASES:
            if name not in stamps and marker in text:
                stamps[name] = round(t - prev, 3)
                prev = t
                break
    return {"ready_s": round(ready, 3), "rss_mb_at_ready": rss, "phases_s": stamps,
            "torch_copies_dropped": "quantized linears dropped" in logged,
            "head_blocks_file_after": any(model_dir.glob(f".kakeya-native-head-{args.weights}-*.safetensors")),
            "layer_blocks_file_after": any(model_dir.glob(f".kakeya-native-layers-{args.weights}-*.safetensors")),
            "compile_auto_file_after": any(model_dir.glob(f".kakeya-compile-auto-{args.weights}.json"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--arms", default="kept,made,measured,before")
    ap.add_argument("--out", default=str(ROOT / "results" / "research" / "daemon_start.json"))
    args = ap.parse_args(argv)
    from inference_engine.model_store import resolve_model

    model_dir = pathlib.Path(resolve_model(args.model))
    meta = run_metadata(vars(args))
    arms = args.arms.split(",")
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="kakeya-daemon-start-") as work:
        if {"kept", "transformers", "fallback"} & set(arms):  # the kept arms need the files: one start (not timed) makes them
            start_once(args, model_dir, "warm", pathlib.Path(work))
        for r in range(args.rounds):
            for a in arms:
                runs[a].append(start_once(args, model_dir, a, pathlib.Path(work)))
                print(f"round {r} {a}: READY after {runs[a][-1]['ready_s']} s {runs[a][-1]['phases_s']}", flush=True)
    summary = {}
    for a, rs in runs.items():
        phases = {name: statistics.median(x["phases_s"][name] for x in rs if name in x["phases_s"])
                  for name, _ in PHASES if any(name in x["phases_s"] for x in rs)}
        rss = [x["rss_mb_at_ready"] for x in rs if x.get("rss_mb_at_ready") is not None]
        summary[a] = {"ready_s_median": statistics.median(x["ready_s"] for x in rs), "phases_s_median": phases,
                      "rss_mb_at_ready_median": statistics.median(rss) if rss else None}
    doc = meta | {"what": "seconds from launching `kakeya serve` to its READY line, the arms interleaved round by round; "
                          "phases from the daemon's log stamps",
                  "arms": runs, "summary": summary}
    if "kept" in summary:
        doc["ready_over_kept"] = {a: round(v["ready_s_median"] / summary["kept"]["ready_s_median"], 3) for a, v in summary.items()}
    write_json(pathlib.Path(args.out), doc)
    print(summary, doc.get("ready_over_kept"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
