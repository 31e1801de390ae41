"""Shared bits for benchmark scripts: run metadata written into every results JSON."""
from __future__ import annotations

import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def git_state() -> tuple[str, bool | str]:
    """(commit, dirty_worktree) of the checkout; "unknown" for what git cannot tell (no git, not a checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown", "unknown"
    commit = head.stdout.strip() if head.returncode == 0 else "unknown"
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else "unknown"
    return commit, dirty


def command_line() -> str:
    """This process's command line as a shell would take it back (arguments quoted where needed)."""
    return shlex.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])


def cpu_info() -> dict:
    """The CPU's model name and vector ISA: torch's dispatch level (DEFAULT / AVX2 / AVX512 / ...) and the
    flags that decide the quantized kernels' speed (bf16 is emulated without avx512_bf16 or AMX)."""
    import torch

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return {"model": model, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "flags": [f for f in wanted if f in flags]}


def run_metadata(config: dict) -> dict:
    """Provenance every results JSON carries: command, commit, dirty flag, date, machine (and its accelerator), config."""
    commit, dirty = git_state()
    import torch

    return {
        "command": command_line(),
        "commit": commit,
        "dirty_worktree": dirty,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu": cpu_info(),
            "cpu_count": os.cpu_count(),
            "accelerator": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "load_average_at_start": os.getloadavg(),
        },
        "config": config,
    }


def percentile(xs, q):
    """The q-quantile (0..1) of xs by nearest rank; None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def write_json(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


def fill_with_random_kv(cache, n: int, chunk: int, generator) -> None:
    """Append random normal K/V to a KV cache through its own API (prepare, update_and_fetch, commit; no model) until
    it holds n positions, `chunk` at a time: archiving and bookkeeping run as in serving, in a fraction of the time."""
    import torch

    g = cache.geometry
    if getattr(cache, "far_switch_due", lambda end: False)(n):  # paged, far_after "context": one append past the
        cache.switch_far()  # context from under far_from switches at its start, as the engine does (Engine._switch_far)
    while cache.next_position < n:
        t = min(chunk, n - cache.next_position)
        cache.prepare(range(cache.next_position, cache.next_position + t))
        for layer in range(g.num_layers):
            k, v = (torch.randn(g.num_kv_heads, t, g.head_dim, generator=generator) for _ in range(2))
            cache.update_and_fetch(layer, k, v)
        cache.commit()


class PeakRSS:
    """Context manager sampling this process's RSS every `interval` s; .peak = max seen inside, .peak_anon = max of its
    anonymous part (rss - shared: less the file-backed pages mapped, such as spill files' or segments' maps)."""

    def __init__(self, interval: float = 0.02):
        import psutil

        self.proc, self.peak, self.interval, self._stop = psutil.Process(), 0, interval, threading.Event()
        self.peak_anon = 0

    def __enter__(self):
        self._sample()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _sample(self):
        m = self.proc.memory_info()
        self.peak, self.peak_anon = max(self.peak, m.rss), max(self.peak_anon, m.rss - m.shared)

    def _run(self):
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sample()
