"""Training/held-out text built only from files already on the machine: man page NAME lines
(/usr/share/man/man1) and Python functions with docstrings (the interpreter's stdlib).

Every item has a source key (command name / module path); keys hashing into the held-out bucket
are used only for the benchmark prompts, never for training. `describe()` records exactly which
files were read (paths, bytes, sha256).
"""
from __future__ import annotations

import ast
import dataclasses
import gzip
import hashlib
import pathlib
import random
import re
import sysconfig

MAN_DIR = pathlib.Path("/usr/share/man/man1")
HELDOUT_MOD = 20  # 1 key in 20 is held out


def is_heldout(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


@dataclasses.dataclass
class SourceFile:
    path: str
    nbytes: int
    sha256: str


@dataclasses.dataclass
class Prompt:
    style: str  # "chat": a user message (chat template applied at tokenization); "code": a raw Python prefix
    text: str
    key: str  # source key (held-out split unit)


@dataclasses.dataclass
class Corpus:
    chat: list[Prompt]
    code: list[Prompt]
    code_text: list[Prompt]  # whole function sources, teacher-forced (off-policy)
    files: list[SourceFile]

    def describe(self) -> dict:
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.sha256}\n".encode())
        return {
            "files": len(self.files),
            "bytes": sum(f.nbytes for f in self.files),
            "files_sha256": h.hexdigest(),
            "roots": sorted({str(pathlib.Path(f.path).parent) if f.path.startswith(str(MAN_DIR)) else "stdlib" for f in self.files}),
        }


_NAME_RE = re.compile(r"^\.SH\s+\"?NAME\"?\s*$", re.I)


def _man_names(limit: int, rng: random.Random, files: list[SourceFile]) -> list[tuple[str, str]]:
    paths = sorted(MAN_DIR.glob("*.gz"))
    rng.shuffle(paths)
    out = []
    for p in paths:
        if len(out) >= limit:
            break
        try:
            raw = p.read_bytes()
            text = gzip.decompress(raw).decode("utf-8", "replace")
        except (OSError, EOFError):
            continue
        lines = text.splitlines()
        for i, ln in enumerate(lines):
            if _NAME_RE.match(ln.strip()) and i + 1 < len(lines):
                nm = lines[i + 1].replace("\\-", "-").replace("\\fB", "").replace("\\fR", "").replace("\\fI", "")
                m = re.match(r"^([\w.+\-\[\], ]+?)\s+-+\s+(.+)$", nm.strip())
                if m and 8 <= len(m.group(2)) <= 120 and not m.group(2).startswith("."):
                    cmd = m.group(1).split(",")[0].strip()
                    out.append((cmd, m.group(2).strip().rstrip(".")))
                    files.append(SourceFile(str(p), len(raw), hashlib.sha256(raw).hexdigest()))
                break
    return out


def _stdlib_functions(limit_files: int, rng: random.Random, files: list[SourceFile]):
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts
                   and "idlelib" not in p.parts)
    rng.shuffle(paths)
    funcs = []
    for p in paths[:limit_files]:
        try:
            raw = p.read_bytes()
            src = raw.decode("utf-8")
            tree = ast.parse(src)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        files.append(SourceFile(str(p), len(raw), hashlib.sha256(raw).hexdigest()))
        mod = ".".join(p.relative_to(root).with_suffix("").parts)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
                doc = ast.get_docstring(node)
                seg = ast.get_source_segment(src, node)
                if not doc or not seg or not (200 <= len(seg) <= 4000):
                    continue
                first = doc.strip().splitlines()[0].strip().rstrip(".")
                if not (12 <= len(first) <= 120):
                    continue
                funcs.append((mod, node.name, first, _dedent(seg, node.col_offset)))
    return funcs


def _dedent(seg: str, col: int) -> str:
    lines = seg.splitlines()
    return "\n".join([lines[0]] + [ln[col:] if ln[:col].strip() == "" else ln for ln in lines[1:]])


_MAN_TEMPLATES = [
    "What does the `{cmd}` command do?",
    "How do I {desc} on Linux?",
    "Explain how to use `{cmd}` with a short example.",
    "I need to {desc}. Which command should I use, and how?",
    "Give me a quick summary of `{cmd}` ({desc}).",
]
_PY_TEMPLATES = [
    "Write a Python function that does the following: {desc}.",
    "Explain what the Python function `{mod}.{func}` does.",
    "What is the `{mod}` module in Python used for?",
    "Write a short Python example that uses `{mod}.{func}`.",
]


def build_corpus(seed: int = 0, man_limit: int = 1500, py_files: int = 400) -> Corpus:
    rng = random.Random(seed)
    files: list[SourceFile] = []
    man = _man_names(man_limit, rng, files)
    funcs = _stdlib_functions(py_files, rng, files)
    chat, code, code_text = [], [], []
    for cmd, desc in man:
        t = rng.choice(_MAN_TEMPLATES)
        d = desc[0].lower() + desc[1:]
        chat.append(Prompt("chat", t.format(cmd=cmd, desc=d), f"man:{cmd}"))
    for mod, func, doc, seg in funcs:
        key = f"py:{mod}"
        t = rng.choice(_PY_TEMPLATES)
        chat.append(Prompt("chat", t.format(mod=mod, func=func, desc=doc[0].lower() + doc[1:]), key))
        code.append(Prompt("code", _code_prefix(seg, rng), key))
        code_text.append(Prompt("code", seg, key))
    return Corpus(chat=chat, code=code, code_text=code_text, files=files)


def _code_prefix(seg: str, rng: random.Random) -> str:
    """The def line, docstring and a few body lines: a natural place for the model to continue."""
    lines = seg.splitlines()
    n = min(len(lines) - 1, max(3, int(len(lines) * rng.uniform(0.25, 0.5))))
    return "\n".join(lines[:n]) + "\n"


def split(prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    train = [p for p in prompts if not is_heldout(p.key)]
    held = [p for p in prompts if is_heldout(p.key)]
    return train, held
