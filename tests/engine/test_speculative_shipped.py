"""SmolLM2 + the shipped dLM drafter: speculative greedy == plain greedy, token for token."""
import json

import pytest

from factories import load_model, require_smollm2
from inference_engine.engine.events import GenerationDone, TokenGenerated
from inference_engine.engine.generate import Engine, GenerateParams
from inference_engine.kv.strategy import KVStrategy

pytestmark = pytest.mark.model


def generate(engine, ids, n):
    evs = list(engine.generate(engine.new_session_kv(), ids, GenerateParams(max_tokens=n)))
    return [e.token_id for e in evs if isinstance(e, TokenGenerated)], next(e for e in evs if isinstance(e, GenerationDone))


@pytest.mark.parametrize("strategy", [KVStrategy("full"), KVStrategy("sink_window", 4, 32)], ids=lambda s: s.name)
def test_shipped_drafter_keeps_greedy_output(strategy):
    path = require_smollm2()
    from kv_cache_proposer import load_drafter, resolve_checkpoint

    model = load_model(str(path))
    drafter = load_drafter("smollm2-135m-dlm", verifier_embed=model.embed, verifier_lm_head=model.lm_head)
    heldout = json.loads((resolve_checkpoint("smollm2-135m-dlm") / "heldout_prompts.json").read_text())
    ar = Engine(model, strategy)
    spec = Engine(model, strategy, drafter=drafter, spec_k=4)
    for p in (heldout["chat"][0], heldout["code"][0]):
        ids = p["ids"]
        assert len(ids) > 36  # sink_window (4 + 32) runs past its window
        want, _ = generate(ar, ids, 24)
        got, done = generate(spec, ids, 24)
        assert got == want
        assert done.drafted_tokens > 0
