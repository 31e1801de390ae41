"""Child process of test_crash_resume: saves turns of one session as fast as it can until killed.

usage: crash_writer.py MODEL_DIR STATE_DIR [SESSION_ID]; prints "SESSION <id>" once, then
"SAVED <history length>" after every save that completed.
"""
import sys

import torch

from inference_engine.engine.events import TokenGenerated
from inference_engine.engine.generate import Engine
from inference_engine.engine.requests import SamplingParams
from inference_engine.kv.strategy import KVStrategy
from inference_engine.backends.torch.model import TorchCausalLM
from inference_engine.persistence.session_files import SessionFiles
from inference_engine.persistence.state_dir import StateDir
from inference_engine.server.runtime import Runtime

torch.set_num_threads(1)
model_dir, root = sys.argv[1], sys.argv[2]
engine = Engine(TorchCausalLM.load(model_dir), KVStrategy("full"), prefill_chunk=64)
rt = Runtime(engine, persister=SessionFiles(StateDir(root), engine))
sid = sys.argv[3] if len(sys.argv) > 3 else rt.create_session([5, 6, 7]).id
print("SESSION", sid, flush=True)
g = torch.Generator().manual_seed(len(rt.history(sid)))
while True:
    rt.append(sid, torch.randint(3, 256, (48,), generator=g).tolist())
    s = rt.store.get(sid)
    with s.lock:
        rt.store.persist(s)  # a save with history only, then one with rows after the turn
    print("SAVED", len(rt.history(sid)), flush=True)
    [e for e in rt.generate(sid, 4, SamplingParams()) if isinstance(e, TokenGenerated)]
    print("SAVED", len(rt.history(sid)), flush=True)
