"""Multi-turn chat against a running daemon with the default model, with per-turn figures.

    make run                              # in one terminal (or: kakeya serve)
    python sdks/python/examples/chat.py   # in another

The runtime never sees text: this script owns tokenization and the chat template (the
pulled model's own) and appends only each turn's new tokens. For an interactive chat, run
`kakeya chat`.
"""
from __future__ import annotations

import argparse
import os

from kakeya import Client
from kakeya.tokenization import ChatHistory, load_tokenizer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default=os.environ.get("KAKEYA_ADDRESS", "127.0.0.1:50051"))
    ap.add_argument("--model", default="smollm2-135m-instruct", help="pulled model name or dir (for the tokenizer)")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    chat = ChatHistory(load_tokenizer(args.model))
    questions = ["What is the capital of France?", "What river runs through it?", "Name one famous museum there."]
    with Client(args.address) as client, client.create_session() as session:
        for q in questions:
            session.append(chat.user(q))
            text = chat.assistant(list(session.generate(max_tokens=args.max_tokens))).strip()
            r = session.last_result
            print(f"user: {q}\nassistant: {text}\n  [prefilled {r.prefill_tokens} new tokens, {r.generated_tokens} generated, "
                  f"ttft {r.time_to_first_token_seconds * 1000:.0f} ms, stop={r.stop_reason}]\n")
        print(session.info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
