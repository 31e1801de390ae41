"""Prompts for the v2 drafter's one-command GPU run (scripts/training/gpu_drafter_run.py), built only from
what a bare machine with Python has: the interpreter's stdlib, the sources and docs of the installed
packages (every site-packages / dist-packages folder on sys.path), man pages where the machine has them,
and the chat prompts the project ships (kv_cache_proposer/data/chat_prompts.jsonl).

Three styles, as the benchmark (scripts/bench_speculative.py) has them:
- chat: a user message (chat template applied at tokenization): the shipped prompts, questions over
  function docstrings (stdlib / packages), man-page NAME lines, and summarise / explain requests over
  documentation paragraphs;
- code: a raw Python prefix (def line, docstring and the first 25-50 % of a function's body);
- edit: the benchmark's "add type hints" request (and a few other edit requests) over the first 200
  tokens of a function, chat-templated.

Every item has a split key (`py:<stdlib module>`, `pkg:<package module>`, `doc:<file>`, `man:<command>`,
`chat:<id>`); held-out keys (corpus.is_heldout, sha1 % 20 == 0; shipped chat prompts: sha1 % 4 == 0) are
used only for evaluation. The stdlib and man keys are those of training/corpus.py, so the benchmark's
held-out prompts (smollm2-135m-dlm/heldout_prompts.json) never reach training either; a training item of
code whose first three lines are those of a held-out code prompt is dropped too (vendored copies of stdlib code).
Reading is bounded by a file count and a deadline; `describe()` records what was read.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import random
import re
import sys
import sysconfig
import time

from kv_cache_proposer.training import corpus as corpus_mod

PROMPTS_FILE = pathlib.Path(__file__).resolve().parents[1] / "data" / "chat_prompts.jsonl"
CHAT_HELDOUT_MOD = 4  # a quarter of the shipped chat prompts are held out (they are few)
EDIT_INSTRUCTION = "Add type hints to this Python function. Reply with the complete function only."  # the benchmark's
OTHER_EDITS = (
    "Add a docstring to this Python function. Reply with the complete function only.",
    "Rename the local variables of this Python function to clearer names. Reply with the complete function only.",
    "Simplify this Python function without changing its behaviour. Reply with the complete function only.",
)
DOC_SUFFIXES = (".md", ".rst", ".txt")
_SKIP_DIRS = {"__pycache__", "test", "tests", "idlelib", "site-packages", "dist-packages", "node_modules", ".git"}
_DEF_RE = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\(")
_HEAD_MD = re.compile(r"^#{1,4}\s+(.{4,80}?)\s*#*\s*$")
_DOC_TEMPLATES = (
    "Summarize the following text in two or three sentences:\n\n{para}",
    "Explain this passage from the {pkg} documentation in simple terms:\n\n{para}",
    "What are the key points of this text?\n\n{para}",
)
_HEAD_TEMPLATES = ("What is {head} in {pkg}?", "Explain {head} ({pkg}) with a short example.")
_PY_TEMPLATES = corpus_mod._PY_TEMPLATES
_MAN_TEMPLATES = corpus_mod._MAN_TEMPLATES


def is_heldout(key: str) -> bool:
    if key.startswith("chat:"):
        return int(hashlib.sha1(key.encode()).hexdigest(), 16) % CHAT_HELDOUT_MOD == 0
    return corpus_mod.is_heldout(key)


@dataclasses.dataclass
class Item:
    style: str  # chat | code | edit
    key: str  # split key
    source: str  # prompts | stdlib | package | doc | man
    text: str  # chat: the user message; code: the raw prefix; edit: the function source (wrapped at tokenization)
    instruction: str = ""  # edit only


@dataclasses.dataclass
class Corpus:
    train: list[Item]
    heldout: list[Item]
    stats: dict

    def describe(self) -> dict:
        return self.stats


def _file_sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _walk(root: pathlib.Path, suffixes: tuple, deadline: float, limit: int) -> list[pathlib.Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith((".dist-info", ".egg-info"))
                             and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(suffixes):
                out.append(pathlib.Path(dirpath) / f)
        if len(out) >= limit or time.monotonic() > deadline:
            break
    return out


def package_roots() -> list[pathlib.Path]:
    """The site-packages / dist-packages folders on sys.path (and the running interpreter's own)."""
    seen, out = set(), []
    cands = list(sys.path)
    for k in ("purelib", "platlib"):
        try:
            cands.append(sysconfig.get_paths()[k])
        except KeyError:
            pass
    for p in cands:
        try:
            q = pathlib.Path(p).resolve()
        except OSError:
            continue
        if q.name in ("site-packages", "dist-packages") and q.is_dir() and q not in seen:
            seen.add(q)
            out.append(q)
    return out


def functions(src: str, max_len: int = 4000):
    """(name, first docstring line or '', dedented source, def-line index) of the functions in a Python source;
    a line scan, not ast (fast, and tolerant of files the running interpreter cannot parse)."""
    lines = src.splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = _DEF_RE.match(lines[i])
        if not m:
            i += 1
            continue
        ind = len(m.group(1).expandtabs())
        j, end = i + 1, i + 1
        while j < len(lines):
            s = lines[j]
            if s.strip():
                lead = len(s.expandtabs()) - len(s.expandtabs().lstrip())
                if lead <= ind and not s.lstrip().startswith((")", "]", "}")):
                    break
                end = j + 1
            j += 1
        body = lines[i:end]
        seg = "\n".join(ln[ind:] if ln[:ind].strip() == "" else ln for ln in body)
        if 200 <= len(seg) <= max_len and not m.group(2).startswith("__"):
            out.append((m.group(2), _docline(body), seg, i))
        i += 1  # nested functions are items too
    return out


def _docline(body: list[str]) -> str:
    for k, ln in enumerate(body[1:12], 1):
        s = ln.strip()
        if not s or (k < 4 and not s.startswith(('"', "'", 'r"', "r'")) and not body[k - 1].rstrip().endswith(":")):
            continue
        for q in ('"""', "'''", 'r"""', "r'''"):
            if s.startswith(q):
                first = s[len(q):].strip().rstrip('"\'').strip() or (body[k + 1].strip() if k + 1 < len(body) else "")
                first = first.rstrip(".")
                return first if 12 <= len(first) <= 120 else ""
        if s.endswith(":") or s.startswith(("def ", "async ")):
            continue
        return ""
    return ""


def code_prefix(seg: str, rng: random.Random) -> str:
    lines = seg.splitlines()
    n = min(len(lines) - 1, max(3, int(len(lines) * rng.uniform(0.25, 0.5))))
    return "\n".join(lines[:n]) + "\n"


def _py_items(seg_list, mod: str, key: str, source: str, rng: random.Random, per_file: int) -> list[Item]:
    rng.shuffle(seg_list)
    out = []
    for name, doc, seg, _ in seg_list[:per_file]:
        out.append(Item("code", key, source, code_prefix(seg, rng)))
        r = rng.random()
        instr = EDIT_INSTRUCTION if r < 0.7 else OTHER_EDITS[int((r - 0.7) / 0.3 * len(OTHER_EDITS)) % len(OTHER_EDITS)]
        out.append(Item("edit", key, source, seg, instruction=instr))
        if doc:
            t = rng.choice(_PY_TEMPLATES)
            out.append(Item("chat", key, source, t.format(mod=mod, func=name, desc=doc[0].lower() + doc[1:])))
    return out


def _doc_items(text: str, pkg: str, key: str, rng: random.Random, per_file: int) -> list[Item]:
    paras, heads = [], []
    for block in re.split(r"\n\s*\n", text):
        b = block.strip()
        first = b.splitlines()[0] if b else ""
        m = _HEAD_MD.match(first)
        if m:
            heads.append(m.group(1).strip("*` "))
            continue
        lines = b.splitlines()
        if len(lines) == 2 and set(lines[1].strip()) <= set("=-~^*#") and 4 <= len(lines[0]) <= 80:
            heads.append(lines[0].strip())
            continue
        letters = sum(c.isalpha() or c == " " for c in b)
        if 200 <= len(b) <= 1500 and letters > 0.75 * len(b):
            paras.append(b)
    rng.shuffle(paras)
    out = [Item("chat", key, "doc", rng.choice(_DOC_TEMPLATES).format(para=p, pkg=pkg)) for p in paras[:per_file]]
    if heads:
        h = rng.choice(heads)
        out.append(Item("chat", key, "doc", rng.choice(_HEAD_TEMPLATES).format(head=h, pkg=pkg)))
    return out


def load_prompts_file(path: pathlib.Path = PROMPTS_FILE) -> tuple[list[dict], str]:
    raw = path.read_bytes()
    rows = [json.loads(ln) for ln in raw.decode("utf-8").splitlines() if ln.strip()]
    return rows, _file_sha(raw)


def build(*, seed: int = 0, max_files: int = 3000, deadline: float | None = None, packages: bool = True,
          man_pages: int = 300, per_file: int = 4, heldout_first_lines: set | None = None,
          prompts_file: pathlib.Path = PROMPTS_FILE, log=lambda s: None) -> Corpus:
    """Read at most max_files source / doc files (about 45 % stdlib, 40 % package sources, 15 % package docs)
    before `deadline` (time.monotonic()), plus man pages and the shipped prompts."""
    t0 = time.monotonic()
    deadline = deadline if deadline is not None else t0 + 60
    rng = random.Random(seed)
    counts = {k: {"files": 0, "bytes": 0, "items": 0} for k in ("prompts", "stdlib", "package", "doc", "man")}
    h_files = hashlib.sha256()
    items: list[Item] = []

    rows, prompts_sha = load_prompts_file(prompts_file)
    for r in rows:
        items.append(Item("chat", f"chat:{r['id']}", "prompts", r["text"]))
    counts["prompts"].update(files=1, bytes=prompts_file.stat().st_size, items=len(rows))

    def read(p: pathlib.Path, kind: str):
        try:
            raw = p.read_bytes()
            if len(raw) > 400_000 or len(raw) < 200:
                return None
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        counts[kind]["files"] += 1
        counts[kind]["bytes"] += len(raw)
        h_files.update(f"{p}\0{_file_sha(raw)}\n".encode())
        return text

    # the stdlib: module keys as training/corpus.py makes them
    std_root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    stdlib, package = int(max_files * 0.45), int(max_files * 0.40)
    share = {"stdlib": stdlib, "package": package, "doc": max_files - stdlib - package}
    walk_deadline = t0 + 0.3 * (deadline - t0)
    std_files = _walk(std_root, (".py",), walk_deadline, 100_000)
    rng.shuffle(std_files)
    src_deadline = t0 + 0.5 * (deadline - t0)  # half the time for the stdlib, then packages
    for p in std_files[: share["stdlib"]]:
        if time.monotonic() > src_deadline:
            break
        text = read(p, "stdlib")
        if text is None:
            continue
        mod = ".".join(p.relative_to(std_root).with_suffix("").parts)
        new = _py_items(functions(text), mod, f"py:{mod}", "stdlib", rng, per_file)
        counts["stdlib"]["items"] += len(new)
        items += new

    roots = package_roots() if packages else []
    pkg_py, pkg_doc = [], []
    for root in roots:
        if time.monotonic() > deadline:
            break
        py = _walk(root, (".py",) + DOC_SUFFIXES, t0 + 0.6 * (deadline - t0), 200_000)
        for p in py:
            (pkg_py if p.suffix == ".py" else pkg_doc).append((root, p))
    rng.shuffle(pkg_py)
    rng.shuffle(pkg_doc)
    py_iter, doc_iter = iter(pkg_py[: share["package"]]), iter(pkg_doc[: share["doc"]])
    pkgs: dict[str, int] = {}
    while time.monotonic() < deadline:
        nxt = [(x, "package") for x in [next(py_iter, None)] if x is not None]
        nxt += [(x, "doc") for x in [next(doc_iter, None)] if x is not None]
        if not nxt:
            break
        for (root, p), kind in nxt:
            text = read(p, kind)
            if text is None:
                continue
            rel = p.relative_to(root)
            pkg = rel.parts[0].split(".")[0] if len(rel.parts) > 1 else rel.stem
            pkgs[pkg] = pkgs.get(pkg, 0) + 1
            if kind == "package":
                mod = ".".join(rel.with_suffix("").parts)
                new = _py_items(functions(text), mod, f"pkg:{mod}", "package", rng, per_file)
            else:
                new = _doc_items(text, pkg, f"doc:{rel}", rng, max(1, per_file // 2))
            counts[kind]["items"] += len(new)
            items += new

    man_files: list = []
    if man_pages and corpus_mod.MAN_DIR.is_dir() and time.monotonic() < deadline:
        for cmd, desc in corpus_mod._man_names(man_pages, rng, man_files):
            t = rng.choice(_MAN_TEMPLATES)
            items.append(Item("chat", f"man:{cmd}", "man", t.format(cmd=cmd, desc=desc[0].lower() + desc[1:])))
            counts["man"]["items"] += 1
        counts["man"]["files"] = len(man_files)
        counts["man"]["bytes"] = sum(f.nbytes for f in man_files)
        for f in man_files:
            h_files.update(f"{f.path}\0{f.sha256}\n".encode())

    train = [it for it in items if not is_heldout(it.key)]
    held = [it for it in items if is_heldout(it.key)]
    firsts = set(heldout_first_lines or ())
    firsts |= {first_lines(it.text) for it in held if it.style != "chat"}
    n0 = len(train)
    train = [it for it in train if it.style == "chat" or first_lines(it.text) not in firsts]
    rng.shuffle(train)
    rng.shuffle(held)
    stats = {
        "read_seconds": round(time.monotonic() - t0, 2),
        "stopped_by_deadline": time.monotonic() > deadline,
        "max_files": max_files,
        "per_source": counts,
        "files_sha256": h_files.hexdigest(),
        "stdlib_root": str(std_root),
        "package_roots": [str(r) for r in roots],
        "packages_read": dict(sorted(pkgs.items(), key=lambda kv: -kv[1])[:40]),
        "packages_read_count": len(pkgs),
        "prompts_file": {"path": str(prompts_file.relative_to(prompts_file.parents[2]) if len(prompts_file.parents) > 2
                                     else prompts_file),
                         "sha256": prompts_sha, "prompts": len(rows)},
        "items": {"train": _by_style(train), "heldout": _by_style(held)},
        "dropped_as_copies_of_heldout_first_lines": n0 - len(train),
        "heldout_rule": f"sha1(key) % {corpus_mod.HELDOUT_MOD} == 0 (keys py:<stdlib module>, pkg:<package module>, doc:<file>, "
                        f"man:<command>); shipped chat prompts sha1('chat:<id>') % {CHAT_HELDOUT_MOD} == 0",
    }
    log(f"corpus: {sum(c['files'] for c in counts.values())} files read in {stats['read_seconds']}s, "
        f"{len(train)} training / {len(held)} held-out items ({stats['items']['train']})")
    return Corpus(train=train, heldout=held, stats=stats)


def first_lines(text: str, n: int = 3) -> str:
    """The first n non-empty lines, stripped (how a copy of a held-out function is recognised)."""
    return "\n".join([ln.strip() for ln in text.splitlines() if ln.strip()][:n])


def _by_style(items: list[Item]) -> dict:
    out: dict = {}
    for it in items:
        out[it.style] = out.get(it.style, 0) + 1
    return out


def interleave(items: list[Item], weights: dict | None = None) -> list[Item]:
    """Styles interleaved in proportion to `weights` (default chat 0.45 / code 0.30 / edit 0.25), so any
    prefix of the list (a generation stage cut by its deadline) covers every style."""
    weights = weights or {"chat": 0.45, "code": 0.30, "edit": 0.25}
    per = {s: [it for it in items if it.style == s] for s in weights}
    per = {s: v for s, v in per.items() if v}
    out, acc = [], {s: 0.0 for s in per}
    idx = {s: 0 for s in per}
    while per:
        for s in list(per):
            acc[s] += weights[s]
        s = max(per, key=lambda k: acc[k])
        acc[s] -= 1.0
        out.append(per[s][idx[s]])
        idx[s] += 1
        if idx[s] >= len(per[s]):
            del per[s]
    return out


class PromptTokenizer:
    """Items -> prompt token ids: the verifier's HF tokenizer and chat template, or (a tokenizer-less tiny test
    verifier) UTF-8 bytes mapped into its vocabulary with a plain-text chat frame."""

    def __init__(self, tok, vocab_size: int):
        self.tok, self.V = tok, vocab_size
        self.kind = "hf" if tok is not None else f"bytes (3 + byte % {vocab_size - 3})"

    def encode(self, text: str) -> list[int]:
        if self.tok is not None:
            return list(self.tok(text, add_special_tokens=False)["input_ids"])
        return [3 + b % (self.V - 3) for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        if self.tok is not None:
            return self.tok.decode(ids)
        return bytes((i - 3) % 256 for i in ids).decode("utf-8", "replace")

    def chat(self, text: str) -> list[int]:
        if self.tok is not None and getattr(self.tok, "chat_template", None):
            s = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
            return self.encode(s)
        return self.encode(f"User: {text}\nAssistant:")

    def ids(self, it: Item) -> list[int]:
        if it.style == "chat":
            return self.chat(it.text)[-512:]
        if it.style == "code":
            return self.encode(it.text)[-192:]
        code = self.decode(self.encode(it.text)[:200])  # the benchmark's edit prompt: the first 200 tokens
        return self.chat(f"{it.instruction or EDIT_INSTRUCTION}\n\n```python\n{code}\n```")[-512:]
