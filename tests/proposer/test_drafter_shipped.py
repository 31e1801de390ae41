"""The shipped SmolLM2 drafter loads by name with the real verifier and drafts its greedy continuation."""
import json

import pytest
import torch
from factories import require_smollm2

from kv_cache_proposer import CHECKPOINTS_DIR, load_drafter

NAME = "smollm2-135m-dlm"


@pytest.mark.model
def test_shipped_drafter_loads_by_name_and_predicts_the_verifier():
    path = require_smollm2()
    if not (CHECKPOINTS_DIR / NAME / "drafter.safetensors").exists():
        pytest.fail(f"the shipped drafter {NAME} is missing from {CHECKPOINTS_DIR}")
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    v = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    d = load_drafter(NAME, verifier_embed=v.get_input_embeddings().weight, verifier_lm_head=v.get_output_embeddings().weight)
    assert d.uses_verifier_hidden and d.context_window >= 16
    held = json.loads((CHECKPOINTS_DIR / NAME / "heldout_prompts.json").read_text())
    hits = total = 0
    for p in held["chat"][:2] + held["code"][:2]:
        ids = torch.tensor([p["ids"]])
        with torch.no_grad():
            out = v.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)
            seq = out[0]
            h = v.model(input_ids=seq[None]).last_hidden_state[0]
        for t in range(ids.shape[1] + 1, seq.numel() - 2, 2):
            lo = max(0, t - d.context_window)
            r = d.draft(seq[lo:t], 2, context_hidden=h[lo : t - 1])
            assert r.ids.shape == (2,) and torch.allclose(r.probs.sum(-1), torch.ones(2), atol=1e-4)
            hits += int(r.ids[0] == seq[t])
            total += 1
    assert total > 0 and hits / total >= 0.15, f"first-token agreement (held-out mean ~0.4) {hits}/{total}"
