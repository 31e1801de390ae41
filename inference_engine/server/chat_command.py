"""`kakeya chat` is the Python SDK's chat: the `kakeya-chat` console script of the `kakeya`
distribution (`kakeya.chat`). The daemon's command line lists it and hands it the arguments by
exec, so the daemon never imports its client, and a runtime installed without the SDK says how to
get it."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

SCRIPT = "kakeya-chat"
HELP = "interactive multi-turn chat with a running daemon (the Python SDK's kakeya-chat; see kakeya chat --help)"


def register(subparsers) -> None:
    """List `chat` among the subcommands; its arguments are the SDK command's (`main` hands them over)."""
    subparsers.add_parser("chat", add_help=False, help=HELP, description=HELP)


def find_script() -> str | None:
    """The SDK's console script: beside this interpreter (the same virtual environment) first, else on PATH."""
    beside = Path(sys.executable).with_name(SCRIPT)
    return str(beside) if beside.is_file() else shutil.which(SCRIPT)


def run(args: list[str]) -> int:
    """Replace this process with `kakeya-chat ARGS` (its exit status is the command's); 2 when it is missing."""
    script = find_script()
    if script is None:
        print(f"kakeya chat: the chat ships with the Python SDK ({SCRIPT}), which is not installed here: "
              f"pip install 'kakeya[tokenizer]' (or `make setup` in the repository)", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(script, [script, *args])
    return 0  # not reached
