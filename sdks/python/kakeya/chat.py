"""`kakeya chat`: an interactive multi-turn chat with a running daemon over the public SDK.

This distribution's `kakeya-chat` console script; the daemon's `kakeya chat` runs it with the same
arguments. One conversation is one daemon session: each turn appends only the tokens the chat template
adds for the new user message (rendered here, on the client), and the reply streams to the
terminal as it is generated. Commands: /info, /reset, /quit. The session id is printed at the
start; `--session ID` reattaches to a session the daemon still holds or saved (after the daemon
or the chat went away). `run_chat` is the whole loop over plain text streams, so tests drive it
with scripted input.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import TextIO

from kakeya import (Client, GenerationResult, KakeyaError, ServerInfo, SessionNotFoundError, UnauthenticatedError,
                    UnavailableError)
from kakeya.client import default_address
from kakeya.local_models import LocalModelNotFoundError
from kakeya.tokenization import ChatHistory, IncrementalDecoder, load_tokenizer

ADDRESS_ENV = "KAKEYA_ADDRESS"  # the one variable every client and example reads (kakeya.client.default_address)
HELP = "commands: /info (session + server), /reset (new session), /quit (or Ctrl-D)"


@dataclass(frozen=True)
class ChatOptions:
    max_tokens: int = 512
    temperature: float = 0.0
    system: str | None = None


class Conversation:
    """One chat: its messages (rendered client side) and the daemon session holding their tokens."""

    def __init__(self, client: Client, tokenizer, options: ChatOptions, session_id: str | None = None):
        """session_id: reattach to that session (it holds the conversation so far) instead of starting one."""
        self.client, self.tokenizer, self.options = client, tokenizer, options
        self.session = None
        if session_id is None:
            self.reset()
            return
        session = client.session(session_id)
        held = session.history()  # NOT_FOUND for an id the daemon neither holds nor saved
        self.history = ChatHistory(self.tokenizer, system=None if held else self.options.system)
        self.history.resume(held)
        self.session, self.resumed_tokens = session, len(held)

    def reset(self) -> None:
        """Close the current session (if any) and start an empty one."""
        self.history = ChatHistory(self.tokenizer, system=self.options.system)
        if self.session is not None:
            self.session.close()
        self.session = self.client.create_session()

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def turn(self, text: str, out: TextIO) -> GenerationResult | None:
        """Send one user message, stream the reply to `out`; None if Ctrl-C cut the reply short."""
        start = self.session.append(self.history.user(text))
        decoder = IncrementalDecoder(self.tokenizer)
        stream = self.session.generate(self.options.max_tokens, temperature=self.options.temperature)
        try:
            for token in stream:
                out.write(decoder.push(token))
                out.flush()
            out.write(decoder.flush() + "\n")
            self.history.assistant(decoder.ids)
            return self.session.last_result
        except KeyboardInterrupt:
            stream.close()  # cancels the call; what the daemon generated stays in the history
            out.write("\n")
            self.history.assistant(self.session.history(start))
            return None


def describe_turn(r: GenerationResult | None) -> str:
    if r is None:
        return "[interrupted: the reply so far stays in the session]"
    decode_s = max(r.total_seconds - r.time_to_first_token_seconds, 1e-9)
    rate = f", {(r.generated_tokens - 1) / decode_s:.1f} tok/s" if r.generated_tokens > 1 else ""
    again = f" (and {r.reencoded_tokens} earlier ones again: the session passed the model's context)" if r.reencoded_tokens else ""
    return (f"[{r.generated_tokens} tokens{rate}, prefilled {r.prefill_tokens} new tokens{again}, "
            f"first token {r.time_to_first_token_seconds * 1000:.0f} ms, stop={r.stop_reason}]")


def describe_info(conv: Conversation, server: ServerInfo) -> str:
    s = conv.session.info()
    params = " ".join(f"{k}={v}" for k, v in sorted(server.kv_params.items()))
    # A bounded strategy allocates its whole window up front: the bytes are allocated, not used.
    room = server.sink + server.window
    of = f" of {room}" if room else ""
    return (f"session {s.session_id}: history {s.history_length} tokens ({len(conv.history.messages)} messages), "
            f"{s.durable_length} saved to disk{f' (not saving: {s.save_error})' if s.save_error else ''}, "
            f"{s.resident_positions}{of} resident positions, resident KV {s.kv_resident_bytes} bytes allocated "
            f"({s.kv_resident_bytes / 2**20:.1f} MiB), page selection {s.kv_selection_bytes / 2**20:.1f} MiB, "
            f"page store {s.kv_stored_bytes / 2**20:.1f} MiB in RAM + {s.kv_cold_bytes / 2**20:.1f} MiB on disk, "
            f"{s.pending_tokens} pending\n"
            f"server {server.server_version}: model {server.model_id}, kv {server.kv_strategy} ({params}), "
            f"{server.backend} on {server.device}, max context {server.max_context}, "
            f"{server.session_capacity} sessions, drafter {server.drafter or 'none'}, "
            f"persistence {server.persistence.mode or 'unreported'}"
            + (f" in {server.persistence.state_dir}" if server.persistence.state_dir else ""))


def _read_line(stdin: TextIO, stdout: TextIO, prompt: str) -> str | None:
    """One line of input, or None at end of input."""
    if stdin is sys.stdin and stdout is sys.stdout and stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        try:
            return input(prompt)
        except EOFError:
            return None
    stdout.write(prompt)
    stdout.flush()
    line = stdin.readline()
    return None if line == "" else line


def run_chat(client: Client, tokenizer, stdin: TextIO, stdout: TextIO, options: ChatOptions = ChatOptions(),
             server: ServerInfo | None = None, session_id: str | None = None) -> int:
    """The chat loop: read lines from `stdin`, write replies and reports to `stdout`. With
    `session_id`, the conversation continues in that session. If the daemon goes away the session
    is left as it is (UnavailableError propagates; the caller says how to reattach)."""
    server = server or client.server_info()
    conv = Conversation(client, tokenizer, options, session_id)
    how = f"reattached to session {conv.session.id} ({conv.resumed_tokens} tokens)" if session_id else f"session {conv.session.id}"
    stdout.write(f"kakeya chat with {server.model_id} ({server.kv_strategy}), {how}\n"
                 f"(to come back to it later: kakeya chat --session={conv.session.id})\n{HELP}\n")
    gone = False
    try:
        while True:
            try:
                line = _read_line(stdin, stdout, "> ")
            except KeyboardInterrupt:
                line = None
            if line is None:
                stdout.write("\n")
                break
            line = line.strip()
            if not line:
                continue
            if line in ("/quit", "/exit"):
                break
            try:
                if line == "/reset":
                    conv.reset()
                    stdout.write(f"[new session {conv.session.id}]\n")
                elif line == "/info":
                    stdout.write(describe_info(conv, server) + "\n")
                elif line.startswith("/"):
                    stdout.write(f"unknown command {line.split()[0]!r}; {HELP}\n")
                else:
                    stdout.write(describe_turn(conv.turn(line, stdout)) + "\n")
            except SessionNotFoundError as e:  # evicted (idle TTL, capacity) or the daemon restarted
                conv.session = None
                conv.reset()
                stdout.write(f"[the session is gone on the daemon ({e}); new session {conv.session.id}]\n")
            except UnavailableError as e:
                gone = True  # the daemon went away: the session stays (saved), for --session to come back to
                e.session_id = conv.session.id if conv.session is not None else None
                raise
            except KakeyaError as e:  # e.g. the context is full: the session stays as it was
                stdout.write(f"[error: {e}; /reset starts over]\n")
    finally:
        try:
            if not gone:
                conv.close()
        except KakeyaError:
            pass
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=default_address(),
                   help=f"the daemon's gRPC HOST:PORT (env {ADDRESS_ENV})")
    p.add_argument("--session", default=None, metavar="ID",
                   help="reattach to this session (its id is printed when a chat starts) instead of starting a new one")
    p.add_argument("--model", default=None,
                   help="pulled model name or model directory for the tokenizer (default: the model the daemon serves)")
    p.add_argument("--max-tokens", type=int, default=ChatOptions.max_tokens, help="most tokens per reply")
    p.add_argument("--temperature", type=float, default=ChatOptions.temperature, help="0 = greedy")
    p.add_argument("--system", default=None, help="system message that opens every session")
    p.add_argument("--api-key", default=os.environ.get("KAKEYA_API_KEY"), help="daemon API key (env KAKEYA_API_KEY)")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tokenizers load from local directories only
    options = ChatOptions(max_tokens=args.max_tokens, temperature=args.temperature, system=args.system)
    with Client(args.address, api_key=args.api_key or None) as client:
        try:
            server = client.server_info()
        except UnavailableError:
            print(f"kakeya chat: no daemon at {args.address}; start one with `make run` or `kakeya serve` "
                  f"(or pass --address, or set {ADDRESS_ENV})", file=sys.stderr)
            return 1
        except UnauthenticatedError:
            given = "the API key given was refused" if args.api_key else "the daemon requires an API key"
            print(f"kakeya chat: {given} by the daemon at {args.address}; pass --api-key KEY or set KAKEYA_API_KEY",
                  file=sys.stderr)
            return 2
        except KakeyaError as e:
            print(f"kakeya chat: error: the daemon at {args.address} answered {e.code.name}: {e}", file=sys.stderr)
            return 2
        try:
            tokenizer = load_tokenizer(args.model or server.model_id)
        except LocalModelNotFoundError as e:
            hint = "" if args.model else f"; the daemon serves {server.model_id!r}: pass --model NAME_OR_DIR for its tokenizer"
            print(f"kakeya chat: error: {e}{hint}", file=sys.stderr)
            return 2
        try:
            return run_chat(client, tokenizer, sys.stdin, sys.stdout, options, server, args.session)
        except SessionNotFoundError as e:
            print(f"kakeya chat: error: {e}", file=sys.stderr)
            return 2
        except UnavailableError as e:
            sid = getattr(e, "session_id", None)
            if sid is None:
                after = ""
            elif server.persistence.mode == "turn":
                after = (f"; session {sid} keeps its saved turns: start the daemon again and run "
                         f"`kakeya chat --session={sid}`")
            else:
                after = f"; session {sid} is gone (the daemon does not persist sessions: --persist off)"
            print(f"kakeya chat: lost the daemon at {args.address} ({e.details}){after}", file=sys.stderr)
            return 1
        except (ImportError, ValueError, KakeyaError) as e:
            print(f"kakeya chat: error: {e}", file=sys.stderr)
            return 2


def main(argv: list[str] | None = None) -> int:
    """The `kakeya-chat` console script; the daemon's `kakeya chat` runs it with the same arguments."""
    p = argparse.ArgumentParser(prog="kakeya chat", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
