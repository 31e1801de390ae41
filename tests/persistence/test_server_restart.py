"""A daemon built the way `kakeya serve` builds it (ServeConfig -> start), stopped and started again in
one process on one state directory: the directory is released at stop, a Generate the client
cancelled is saved, and GetServerInfo says where sessions go."""
from __future__ import annotations

import threading

import pytest
import torch

import kakeya
from factories import tiny_model_dir
from inference_engine.server.app import ConfigError, ServeConfig, start


def _cfg(state_dir, **kw) -> ServeConfig:
    return ServeConfig(bind="127.0.0.1:0", model=str(tiny_model_dir("llama")), weights="fp32", kv_strategy="sink_window",
                       sink=4, window=32, prefill_chunk=16, threads=1, state_dir=str(state_dir), **kw)


def _ids(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_stop_releases_the_state_dir_and_a_new_daemon_takes_it(tmp_path):
    first = start(_cfg(tmp_path))
    try:
        with pytest.raises(ConfigError, match="another kakeya daemon is using the state directory"):
            start(_cfg(tmp_path))
        with kakeya.Client(f"127.0.0.1:{first.port}") as c:
            p = c.server_info().persistence
            assert (p.mode, p.state_dir) == ("turn", str(tmp_path))
            s = c.create_session(_ids(20, 1), ignore_eos=True)
            want = s.history() + list(s.generate(max_tokens=4))
    finally:
        first.stop()
    second = start(_cfg(tmp_path))  # same process, same directory: the lock went with stop()
    try:
        with kakeya.Client(f"127.0.0.1:{second.port}") as c:
            assert c.session(s.id).history() == want
    finally:
        second.stop()
    off = start(_cfg(tmp_path, persist="off"))
    try:
        with kakeya.Client(f"127.0.0.1:{off.port}") as c:
            p = c.server_info().persistence
            assert (p.mode, p.state_dir) == ("off", "")
    finally:
        off.stop()


def test_a_generate_the_client_cancelled_is_saved_and_resumes(tmp_path):
    prompt = _ids(40, 2)
    first = start(_cfg(tmp_path))
    try:
        with kakeya.Client(f"127.0.0.1:{first.port}") as c:
            s = c.create_session(prompt, ignore_eos=True)
            gen = s.generate(max_tokens=100_000)
            streamed = [next(gen) for _ in range(3)]
            gen.close()  # cancels the RPC mid-stream
            live = first.runtime.store.get(s.id, touch=False)
            for _ in range(200):  # the server notices, stops, commits and saves
                if not live.lock.locked():
                    break
                threading.Event().wait(0.05)
            assert not live.lock.locked()
            committed = s.history()
            assert committed[:40] == prompt and committed[40:43] == streamed and 43 <= len(committed) < 40 + 100_000
    finally:
        first.stop()
    second = start(_cfg(tmp_path))
    try:
        with kakeya.Client(f"127.0.0.1:{second.port}") as c:
            resumed = c.session(s.id)
            assert resumed.history() == committed  # every committed token, the ones streamed after the cancel too
            info = resumed.info()
            # the KV state saved with it: everything but the last generated token is prefilled
            assert (info.history_length, info.pending_tokens) == (len(committed), 1)
            got = list(resumed.generate(max_tokens=6))
            with c.create_session(committed, ignore_eos=True) as fresh:  # the same history prefilled anew
                assert got == list(fresh.generate(max_tokens=6))
    finally:
        second.stop()
