import os

from kakeya import Client
from kakeya.tokenization import ChatHistory, load_tokenizer

tok = load_tokenizer("smollm2-135m-instruct")  # a pulled model's name, or a model directory
chat = ChatHistory(tok)  # the model's chat template, applied here on the client
address = os.environ.get("KAKEYA_ADDRESS", "127.0.0.1:50051")
with Client(address) as client, client.create_session() as session:
    for question in ["Hi! Who are you?", "What can you help me with?"]:
        session.append(chat.user(question))            # only this turn's new tokens
        reply = list(session.generate(max_tokens=32))  # greedy; pass temperature/top_p/seed to sample
        print(chat.assistant(reply))
        r = session.last_result
        print(f"  [{r.stop_reason}: prefilled {r.prefill_tokens} new tokens, history {session.info().history_length}]")
