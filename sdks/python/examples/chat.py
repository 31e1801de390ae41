"""Multi-turn chat against a running daemon with the default model.

    make run                      # in one terminal (or: kakeya serve)
    python sdks/python/examples/chat.py

The runtime never sees text: this script owns tokenization and the chat template
(SmolLM2's own, from the pulled model directory) and appends only each turn's new tokens.
"""
from __future__ import annotations

import argparse

from kakeya import Client
from kakeya.tokenization import chat_delta, load_tokenizer
from inference_engine.model_store import resolve_model


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="pulled model name or dir (for the tokenizer)")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()

    tok = load_tokenizer(str(resolve_model(args.model)))
    questions = ["What is the capital of France?", "What river runs through it?", "Name one famous museum there."]
    messages: list[dict] = []
    with Client(args.target) as client, client.create_session() as session:
        for q in questions:
            before = list(messages)
            messages.append({"role": "user", "content": q})
            session.append(chat_delta(before, messages, tok))
            reply = list(session.generate(max_tokens=args.max_tokens))
            text = tok.decode(reply, skip_special_tokens=True).strip()
            messages.append({"role": "assistant", "content": text})
            r = session.last_result
            print(f"user: {q}\nassistant: {text}\n  [prefilled {r.prefill_tokens} new tokens, {r.generated_tokens} generated, "
                  f"ttft {r.time_to_first_token_seconds * 1000:.0f} ms, stop={r.stop_reason}]\n")
        print(session.info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
