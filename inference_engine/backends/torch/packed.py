"""Quantized weights kept between loads: the int8 / int4 linears' tensors, packed, in one safetensors file next to
the model (`.kakeya-packed-<format>.safetensors`), so a daemon start reads them instead of packing them again.

Packing SmolLM2-135M's int4 weights (torch's int4pack layout, the head's int8 and int4 copies) took most of a
daemon start on the 2-core box: the model load took 20.8 s without the file and 10.1 s with it (measured while
another job held both cores; `_load_model` of the daemon's defaults, int4). The file is read with plain reads into one
aligned allocation (`_read_if_key`), not copied out of a memory map. torch's packed layout belongs to the torch version and
the CPU it was made on, so the file records those and the model files' sizes and times; a load that finds
another key packs again and writes the file anew. A directory that cannot be written is only logged: the
weights are packed in memory as before.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import pathlib
import tempfile
from typing import Any

import torch

log = logging.getLogger("kakeya")

FORMAT = 1


def cache_key(model_dir: pathlib.Path, weights: str) -> str:
    """What a file derived from the model's weights is valid for: this format, the weight format, the torch version,
    the CPU's capability and the model files' sizes and times."""
    sources = sorted(p for p in pathlib.Path(model_dir).iterdir()
                     if p.is_file() and p.suffix in (".gguf", ".safetensors") and not p.name.startswith(".kakeya-"))
    return json.dumps({"format": FORMAT, "weights": weights, "torch": torch.__version__,
                       "cpu": torch.backends.cpu.get_cpu_capability(),
                       "sources": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sources}}, sort_keys=True)


def load_derived(model_dir: pathlib.Path, name: str, weights: str) -> dict | None:
    """A small JSON made from the model (`.kakeya-<name>-<weights>.json`, save_derived) when it was made for this
    cache_key, else None."""
    path = pathlib.Path(model_dir) / f".kakeya-{name}-{weights}.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc.get("data") if doc.get("key") == cache_key(model_dir, weights) else None


def write_atomically(path: pathlib.Path, write) -> bool:
    """write(tmp) fills a temp file next to `path`, which then replaces `path` in one rename, readable like the rest of
    a shared model cache (mkstemp makes 0600). A directory that cannot be written is only logged (the next load makes
    the file again); the temp file never stays. Returns whether `path` was written."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kakeya-", suffix=".tmp", dir=path.parent)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return True
    except OSError as e:
        log.info("%s not saved (%s): the next load makes it again", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return False


def save_derived(model_dir: pathlib.Path, name: str, weights: str, data: dict) -> None:
    """Write `data` for load_derived, atomically; a directory that cannot be written is only logged."""
    doc = json.dumps({"key": cache_key(model_dir, weights), "data": data})
    write_atomically(pathlib.Path(model_dir) / f".kakeya-{name}-{weights}.json", lambda tmp: pathlib.Path(tmp).write_text(doc))


DERIVED_KEPT = 2  # versions of one derived tensor file kept per (name, weights), the most recently used


def _derived_path(model_dir: pathlib.Path, name: str, weights: str, extra: str) -> pathlib.Path:
    """`.kakeya-<name>-<weights>-<tag>.safetensors`, tagged by `extra` (the code that makes it): two checkouts of
    different code sharing a model directory each keep their own file instead of replacing each other's at every
    start."""
    return pathlib.Path(model_dir) / f".kakeya-{name}-{weights}-{hashlib.sha256(extra.encode()).hexdigest()[:12]}.safetensors"


def load_derived_tensors(model_dir: pathlib.Path, name: str, weights: str, extra: str) -> dict[str, torch.Tensor] | None:
    """Tensors made from the model (save_derived_tensors) when they were made for this cache_key and `extra` (what else
    they depend on: the code that made them), else None; an unreadable file is logged and counts as missing. A file
    read is marked used (its mtime), so the versions kept are the most recently used."""
    path = _derived_path(model_dir, name, weights, extra)
    if not path.exists():
        return None
    try:
        loaded = _read_if_key(path, cache_key(model_dir, weights) + "|" + extra)
    except Exception as e:  # noqa: BLE001 - a damaged cache only costs making it again
        log.warning("%s unreadable (%s): made again", path, e)
        return None
    if loaded is not None:
        with contextlib.suppress(OSError):  # a read-only model directory: nothing to mark
            _mark_used(path)
    return loaded


def _mark_used(path: pathlib.Path) -> None:
    """The file's mtime set to now in nanoseconds: the kernel stamps writes and a bare utime with its coarse clock
    (a tick of a few ms), so a file read and another written within one tick could tie, and the MRU order would not
    be the order of use."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _mtime_ns(path: pathlib.Path) -> int | None:
    """The file's mtime, or None when it is gone: another process sharing the model directory (a second daemon
    starting beside this one) may remove a version between the listing and this look."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def save_derived_tensors(model_dir: pathlib.Path, name: str, weights: str, extra: str, tensors: dict) -> None:
    """Write `tensors` for load_derived_tensors, atomically, then remove this (name, weights)'s other versions but the
    DERIVED_KEPT most recently used (and an untagged file from before the tags); a directory that cannot be written is
    only logged."""
    from safetensors.torch import save_file

    key = cache_key(model_dir, weights) + "|" + extra
    path = _derived_path(model_dir, name, weights, extra)
    if not write_atomically(path, lambda tmp: save_file({k: t.contiguous() for k, t in tensors.items()}, tmp, metadata={"key": key})):
        return
    with contextlib.suppress(OSError):
        _mark_used(path)
    d = pathlib.Path(model_dir)
    stamped = [(m, f) for f in d.glob(f".kakeya-{name}-{weights}-*.safetensors") if (m := _mtime_ns(f)) is not None]
    versions = [f for _, f in sorted(stamped, key=lambda mf: mf[0], reverse=True)]
    for old in [f for f in versions if f != path][DERIVED_KEPT - 1:] + list(d.glob(f".kakeya-{name}-{weights}.safetensors")):
        with contextlib.suppress(OSError):
            old.unlink()


def load_derived_tensor(model_dir: pathlib.Path, name: str, weights: str, extra: str) -> torch.Tensor | None:
    """One tensor of load_derived_tensors (save_derived_tensor)."""
    loaded = load_derived_tensors(model_dir, name, weights, extra)
    return None if loaded is None else loaded.get("t")


def save_derived_tensor(model_dir: pathlib.Path, name: str, weights: str, extra: str, t: torch.Tensor) -> None:
    save_derived_tensors(model_dir, name, weights, extra, {"t": t})


def open_holding(path: pathlib.Path, key: str, names) -> Any:
    """The packed file at `path` opened for reading when it was made for `key` and holds every layer in `names`
    (its header read, not its data), else None. TorchCausalLM.defer_fallback keeps it open: a file replaced or
    removed later still reads, through this handle, the bytes the load had."""
    try:
        f = open(path, "rb")
    except OSError:
        return None
    try:
        header = _header(f)
        held = {k.split("/")[0] for k in header if k != "__metadata__"}
        if (header.get("__metadata__") or {}).get("key") == key and set(names) <= held:
            return f
    except (OSError, ValueError):
        pass
    f.close()
    return None


def reread(f, key: str) -> dict[str, torch.Tensor]:
    """The tensors of a packed file kept open by open_holding, read again."""
    loaded = _read_if_key(pathlib.Path(f.name), key, f)
    if loaded is None:
        raise RuntimeError(f"{f.name} no longer holds the packed weights this daemon loaded")
    return loaded


class PackedWeights:
    def __init__(self, model_dir: pathlib.Path, weights: str):
        self.path = pathlib.Path(model_dir) / f".kakeya-packed-{weights}.safetensors"
        self.key = cache_key(model_dir, weights)
        self.loaded: dict[str, torch.Tensor] = {}
        self.made: dict[str, torch.Tensor] = {}
        self.hits = self.misses = 0
        if self.path.exists():
            try:
                loaded = _read_if_key(self.path, self.key)
                if loaded is None:
                    log.info("packed weights %s were made for another torch, CPU or model file: packing again", self.path)
                else:
                    self.loaded = loaded
            except Exception as e:  # noqa: BLE001 - a damaged cache only costs the packing
                log.warning("packed weights %s unreadable (%s): packing again", self.path, e)

    def discard(self) -> None:
        """Forget the file's tensors (it will be written anew from what is packed next)."""
        self.loaded, self.made, self.hits, self.misses = {}, {}, 0, 0

    def lookup(self, name: str) -> dict[str, torch.Tensor] | None:
        st = state_of(self.loaded, name)
        if st:
            self.hits += 1
            return st
        self.misses += 1
        return None

    def store(self, name: str, state: dict[str, torch.Tensor]) -> None:
        self.made |= {f"{name}/{k}": v.contiguous() for k, v in state.items()}

    def save(self) -> None:
        """Write what was packed in this load (nothing when everything came from the file), atomically."""
        if not self.made:
            return
        from safetensors.torch import save_file

        tensors = {k: v.clone() for k, v in self.loaded.items()} | self.made  # loaded ones are views of one buffer
        if write_atomically(self.path, lambda tmp: save_file(tensors, tmp, metadata={"key": self.key})):
            log.info("packed weights saved to %s (%.0f MB)", self.path, self.path.stat().st_size / 1e6)


# safetensors' dtype names (the format's header) for what a packed file holds
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64, "BOOL": torch.bool,
           "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
_ALIGN = 64  # torch's CPU allocations are 64-byte aligned; its kernels may assume it


def _header(f) -> dict:
    """A safetensors file's JSON header, read from its start (the file is left just past it)."""
    f.seek(0)
    n = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(n))


def state_of(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """One packed linear's state (its tensors without the `name/` prefix) out of a packed file's tensors."""
    prefix = name + "/"
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def _read_if_key(path: pathlib.Path, key: str, f=None) -> dict[str, torch.Tensor] | None:
    """A packed file's tensors when its metadata key is `key` (else None), read with plain reads into one allocation,
    each tensor at a 64-byte aligned offset. The file's own offsets are only 8-byte aligned, and copying each tensor
    out of a memory map (safetensors' get_tensor, then clone) faults the map in a page at a time: for SmolLM2's 197 MB
    on the loaded 2-core box, 4.5 s against 0.3 s for the reads (a one-off timing in a Python shell, not a bench).
    The layout is safetensors' documented one (an 8-byte little-endian header length, a JSON header, the data). A
    dtype missing from `_DTYPES` makes the file unreadable here: packed again, as for a damaged file. f: the file
    already open (read from its start; left open), else `path` is opened."""
    with (open(path, "rb") if f is None else contextlib.nullcontext(f)) as f:
        header = _header(f)
        n = f.tell() - 8
        if (header.pop("__metadata__", None) or {}).get("key") != key:
            return None
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        places, size = [], 0
        for _, e in entries:
            places.append(size)
            size += -(-(e["data_offsets"][1] - e["data_offsets"][0]) // _ALIGN) * _ALIGN
        buf = torch.empty(size, dtype=torch.uint8)
        raw = memoryview(buf.numpy().data)
        out = {}
        for (name, e), at in zip(entries, places):
            a, b = e["data_offsets"]
            f.seek(8 + n + a)
            if f.readinto(raw[at:at + b - a]) != b - a:
                raise ValueError(f"{path} ends inside tensor {name}")
            out[name] = buf[at:at + b - a].view(_DTYPES[e["dtype"]]).view(e["shape"])
        return out
