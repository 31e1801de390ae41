"""The shipped v2 drafter loads by name the way `kakeya serve --drafter NAME` loads it, and speculation
with it on int4 SmolLM2 reproduces plain greedy decoding while accepting a share of its drafts."""
import json

import pytest
import torch
from factories import require_smollm2

from kv_cache_proposer import CHECKPOINTS_DIR
from kv_cache_proposer.dflash_drafter import DFlashDrafter

NAME = "smollm2-135m-dflash"
# held-out alpha of the shipped checkpoint at k = 4 is 0.18-0.24 (results/speculative_dflash_gpu.json); this floor is
# below it and far above what drafts unrelated to the verifier reach (~0)
ALPHA_FLOOR = 0.04


@pytest.mark.model
def test_shipped_v2_drafter_serves_by_name_and_speculation_is_exact():
    path = require_smollm2()
    ck = CHECKPOINTS_DIR / NAME
    if not (ck / "drafter.safetensors").exists():
        pytest.fail(f"the shipped drafter {NAME} is missing from {CHECKPOINTS_DIR}")
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["format"] == "kakeya-drafter/2" and manifest["weights_dtype"] == "float16"
    # the CPU trainer's manifest records its data under data.used, the GPU run's (gpu_drafter_run.py) under data.generation
    data = manifest["data"].get("used") or manifest["data"]["generation"]
    assert set(data["per_style"]) == {"chat", "code", "edit"}
    assert manifest["training"]["trained_on"]["device"] in ("cpu", "cuda")
    torch.set_num_threads(1)
    from inference_engine.backends.torch.model import TorchCausalLM
    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.generate import GenerateParams
    from inference_engine.server.app import build_engine
    from inference_engine.server.config import ServeConfig

    model = TorchCausalLM.load(path, weights="int4")
    spec = build_engine(ServeConfig(drafter=NAME, spec_k=4), model)
    ar = build_engine(ServeConfig(), model)
    assert isinstance(spec.drafter, DFlashDrafter) and len(spec.drafter.capture_layers) >= 3
    held = json.loads((CHECKPOINTS_DIR / "smollm2-135m-dlm" / "heldout_prompts.json").read_text())
    drafted = accepted = 0
    for p in held["code"][:2] + held["chat"][:1]:
        outs = []
        for engine in (ar, spec):
            evs = list(engine.generate(engine.new_session_kv(), p["ids"], GenerateParams(max_tokens=32)))
            outs.append([e.token_id for e in evs if isinstance(e, TokenGenerated)])
        assert outs[0] == outs[1]
        drafted, accepted = drafted + evs[-1].drafted_tokens, accepted + evs[-1].accepted_tokens
    assert drafted > 0 and accepted / drafted >= ALPHA_FLOOR, f"accepted {accepted}/{drafted}"
