"""Greedy `full` output is token-identical to transformers' greedy generate (INV-3, 2nd clause)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from factories import make_engine, require_smollm2, tiny_model_dir
from inference_engine.engine.generate import GenerateParams
from inference_engine.engine.events import TokenGenerated


def engine_greedy(engine, prompt, n):
    kv = engine.new_session_kv()
    evs = engine.generate(kv, prompt, GenerateParams(max_tokens=n))
    return [e.token_id for e in evs if isinstance(e, TokenGenerated)]


def hf_greedy(path, prompt, n):
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "mistral"])
def test_tiny_full_greedy_matches_transformers(arch):
    path = str(tiny_model_dir(arch))
    engine = make_engine(arch, "full", prefill_chunk=16)  # several prefill chunks
    g = torch.Generator().manual_seed(1)
    for length in (5, 37, 70):  # gemma3's local window is 16: crosses it
        prompt = torch.randint(3, 256, (length,), generator=g).tolist()
        assert engine_greedy(engine, prompt, 24) == hf_greedy(path, prompt, 24)


@pytest.mark.model
def test_smollm2_full_greedy_matches_transformers():
    path = require_smollm2()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    engine = make_engine(model_path=str(path), strategy="full")
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        [{"role": "user", "content": "List three colors of the rainbow."}],
    ]
    for messages in prompts:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert engine_greedy(engine, ids, 32) == ref
