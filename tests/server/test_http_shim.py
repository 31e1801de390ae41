"""Deprecated OpenAI-style HTTP shim, driven by the official `openai` package against a live server.

Most tests use a tiny random-weight model with a byte-level tokenizer built here (fast, and
its random output exercises multi-byte detokenization); the `model`-marked ones use the
pulled SmolLM2 for real text.
"""
import functools
import json
import pathlib
import socket
import tempfile
import time

import httpx
import openai
import pytest

from factories import make_engine, require_smollm2
from inference_engine.model_store.tiny import make_tiny_model
from inference_engine.server.app import ConfigError, ServeConfig, start
from inference_engine.server.http_openai import DEPRECATION_HEADERS
from inference_engine.server.http_shim import start_http_shim
from inference_engine.server.http_text import StopMatcher
from kakeya.tokenization import IncrementalDecoder
from inference_engine.server.runtime import Runtime

API_KEY = "test-key-0123"
WINDOW = 120  # sink_window(4, 120): the shim's prompt limit is 124 tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="kakeya-http-shim-"))


# -- factories ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def text_model_dir(*, tokenizer: bool = True, chat_template: bool = True, never_eos: bool = False) -> pathlib.Path:
    """Tiny llama (vocab 259) + a byte-level tokenizer laid out like SmolLM2's (0 endoftext, 1 im_start, 2 im_end = EOS).

    `never_eos` zeroes EOS's (tied) embedding row, so its logit is 0 and greedy decoding
    never picks it: streams that must still be running when a test acts on them.
    """
    out = make_tiny_model("llama", _ROOT / f"tiny-tok{int(tokenizer)}-chat{int(chat_template)}-noeos{int(never_eos)}", vocab_size=259)
    if never_eos:
        from safetensors.torch import load_file, save_file

        weights = load_file(out / "model.safetensors")
        weights["model.embed_tokens.weight"][2] = 0.0
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    if tokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {s: i for i, s in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])}
        for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
            vocab[ch] = len(vocab)
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tk.decoder = decoders.ByteLevel()
        fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                       unk_token="<|endoftext|>", pad_token="<|im_end|>")
        if chat_template:
            fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=None)
def tokenizer_of(model_dir: pathlib.Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Shim:
    def __init__(self, model_dir, *, api_key=API_KEY, capacity=4, window=WINDOW):
        engine = make_engine("llama", "sink_window", 4, window, model_path=str(model_dir), prefill_chunk=64)
        self.runtime = Runtime(engine, capacity=capacity)
        cfg = ServeConfig(bind="127.0.0.1:0", model=str(model_dir), http_port=free_port(), api_key=api_key, capacity=capacity)
        self.running = start(cfg, self.runtime)
        self.url = f"http://127.0.0.1:{cfg.http_port}/v1"
        self.client = openai.OpenAI(base_url=self.url, api_key=api_key or "unused", max_retries=0, timeout=60)
        self.model = self.runtime.server_info().model_id

    def stop(self):
        self.client.close()
        self.running.stop()


def wait_no_sessions(runtime, timeout=10.0):
    deadline = time.monotonic() + timeout
    while len(runtime.store) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(runtime.store) == 0, "a single-shot session was left open"


def greedy_reference(runtime, prompt_ids, max_tokens, tok):
    """What the shim must return: the runtime's own greedy tokens, decoded in one go."""
    from inference_engine.engine.events import TokenGenerated
    from inference_engine.engine.sampling import SamplingParams

    s = runtime.create_session(prompt_ids, [tok.eos_token_id])
    try:
        ids = [ev.token_id for ev in runtime.generate(s.id, max_tokens, SamplingParams()) if isinstance(ev, TokenGenerated)]
    finally:
        runtime.close(s.id)
    return ids, tok.decode(ids, skip_special_tokens=True)


def cancelled_count(runtime) -> float:
    return runtime.metrics.registry.get_sample_value("generate_requests_total", {"stop_reason": "cancelled"}) or 0.0


@pytest.fixture(scope="module")
def shim():
    s = Shim(text_model_dir())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def endless():
    """A shim whose greedy streams never end on their own (capacity 2: one stream + one request)."""
    s = Shim(text_model_dir(never_eos=True), capacity=2)
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _sessions_closed(request):
    yield
    for name in ("shim", "endless"):
        if name in request.fixturenames:
            wait_no_sessions(request.getfixturevalue(name).runtime)


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hi, naïvely ☃"}]


# -- endpoints ---------------------------------------------------------------------------
def test_models_list_and_deprecation_headers(shim):
    raw = shim.client.models.with_raw_response.list()
    for name, value in DEPRECATION_HEADERS.items():
        assert raw.headers[name] == value
    assert "docs/grpc.md" in raw.headers["link"] and 'rel="deprecation"' in raw.headers["link"]
    assert [m.id for m in raw.parse().data] == [shim.model] == ["tiny-llama"]
    assert shim.client.models.retrieve(shim.model).id == shim.model


def test_chat_non_stream_equals_runtime_greedy(shim):
    tok = tokenizer_of(text_model_dir())
    prompt = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)["input_ids"]
    ids, text = greedy_reference(shim.runtime, prompt, 12, tok)
    r = shim.client.chat.completions.create(model=shim.model, messages=MESSAGES, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == text
    assert c.finish_reason == ("stop" if ids[-1] == tok.eos_token_id else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), len(ids), len(prompt) + len(ids))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == shim.model


def test_chat_stream_matches_non_stream_and_reports_usage(shim):
    kw = dict(model=shim.model, messages=MESSAGES, max_completion_tokens=14, temperature=0)
    full = shim.client.chat.completions.create(**kw)
    chunks = list(shim.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_sampling_is_seeded(shim):
    kw = dict(model=shim.model, prompt="seed me", max_tokens=10, temperature=0.9, top_p=0.95)
    a, b, c = (shim.client.completions.create(seed=s, **kw).choices[0].text for s in (7, 7, 8))
    assert a == b and a != c


def test_completions_text_and_token_prompts(shim):
    tok = tokenizer_of(text_model_dir())
    prompt_ids = tok.encode("Once upon a time")
    _, text = greedy_reference(shim.runtime, prompt_ids, 10, tok)
    for prompt in ("Once upon a time", prompt_ids, ["Once upon a time"]):
        r = shim.client.completions.create(model=shim.model, prompt=prompt, max_tokens=10, temperature=0)
        assert r.choices[0].text == text and r.usage.prompt_tokens == len(prompt_ids) and r.object == "text_completion"
    streamed = shim.client.completions.create(model=shim.model, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


@pytest.mark.parametrize("prompt", ["a", "go"])  # greedy continuations that end in EOS after 14 and 1 tokens
def test_eos_finishes_with_stop_and_is_counted_not_shown(shim, prompt):
    tok = tokenizer_of(text_model_dir())
    ids, text = greedy_reference(shim.runtime, tok.encode(prompt), 16, tok)
    assert ids[-1] == tok.eos_token_id and len(ids) < 16
    r = shim.client.completions.create(model=shim.model, prompt=prompt, max_tokens=16, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (text, "stop", len(ids))
    chunks = list(shim.client.completions.create(model=shim.model, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(shim, stream):
    kw = dict(model=shim.model, prompt="stop here", max_tokens=16, temperature=0)
    text = shim.client.completions.create(**kw).choices[0].text
    stop = text[5:7]
    expected = text[: text.find(stop)]
    r = shim.client.completions.create(stop=[stop, "\u2603never"], stream=stream, **kw)
    if stream:
        chunks = list(r)
        got, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        got, finish = r.choices[0].text, r.choices[0].finish_reason
    assert (got, finish) == (expected, "stop")


# -- errors ------------------------------------------------------------------------------
def test_auth_failure(shim):
    bad = openai.OpenAI(base_url=shim.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=shim.model, messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.get(f"{shim.url}/models")  # no Authorization header at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["Sunset"] == DEPRECATION_HEADERS["Sunset"] and r.headers["WWW-Authenticate"] == "Bearer"
    # auth is checked before the body is read: garbage from a stranger is still 401
    assert httpx.post(f"{shim.url}/chat/completions", content=b"{nope").status_code == 401


def test_malformed_bodies_are_400_in_openai_shape(shim):
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for body, param in [
        (b"{nope", None),
        (b"[1, 2]", None),
        (json.dumps({"model": shim.model}).encode(), "messages"),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"messages": MESSAGES, "temperature": 5}).encode(), "temperature"),
        (json.dumps({"messages": MESSAGES, "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"messages": MESSAGES, "n": 2}).encode(), "n"),
        (json.dumps({"messages": MESSAGES, "stop": [""]}).encode(), "stop"),
        (json.dumps({"messages": [{"content": "no role"}]}).encode(), "messages"),
        (json.dumps({"messages": [*MESSAGES, {"role": "wizard", "content": "x"}]}).encode(), "messages[2].role"),
    ]:
        r = httpx.post(f"{shim.url}/chat/completions", content=body, headers=auth)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param, (body, err)
        assert r.headers["Deprecation"] == DEPRECATION_HEADERS["Deprecation"]
    with pytest.raises(openai.BadRequestError, match="not supported"):
        shim.client.chat.completions.create(model=shim.model, messages=MESSAGES, max_tokens=2, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        shim.client.completions.create(model=shim.model, prompt=["a", "b"], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        shim.client.completions.create(model=shim.model, prompt=[5, 259], max_tokens=2)
    r = httpx.get(f"{shim.url}/nowhere", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and "Sunset" in r.headers


def test_unknown_model_is_404(shim):
    with pytest.raises(openai.NotFoundError) as e:
        shim.client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert e.value.code == "model_not_found" and "tiny-llama" in e.value.message
    with pytest.raises(openai.NotFoundError):
        shim.client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("stream", [False, True])
def test_too_long_prompt_is_400(shim, stream):
    with pytest.raises(openai.BadRequestError) as e:
        shim.client.chat.completions.create(model=shim.model, messages=[{"role": "user", "content": "x" * 200}],
                                            max_tokens=2, stream=stream)
    assert e.value.code == "context_length_exceeded" and "124" in e.value.message


def test_abandoned_stream_is_cancelled_and_closed_while_others_are_served(endless):
    s, rt = endless, endless.runtime
    cancelled_before = cancelled_count(rt)
    stream = s.client.chat.completions.create(model=s.model, messages=MESSAGES, max_tokens=4000, temperature=0, stream=True)
    it = iter(stream)
    got = [next(it) for _ in range(3)]  # role chunk + two pieces of text
    assert got[0].choices[0].delta.role == "assistant" and len(rt.store) == 1
    other = s.client.completions.create(model=s.model, prompt="meanwhile", max_tokens=4, temperature=0)
    assert other.usage.completion_tokens == 4 and other.choices[0].finish_reason == "length"
    assert len(rt.store) == 1  # the abandoned-to-be stream is still generating
    stream.close()  # the client walks away mid-stream
    wait_no_sessions(rt)
    assert cancelled_count(rt) == cancelled_before + 1
    again = s.client.chat.completions.create(model=s.model, messages=MESSAGES, max_tokens=3, temperature=0)
    assert again.usage.completion_tokens == 3


def test_at_capacity_is_503(endless):
    s = endless
    streams = [s.client.completions.create(model=s.model, prompt=f"hold slot {i}", max_tokens=4000, temperature=0, stream=True)
               for i in range(2)]
    for stream in streams:
        it = iter(stream)
        while not next(it).choices[0].text:  # a token exists: this session is generating, so it cannot be evicted
            pass
    with pytest.raises(openai.InternalServerError) as e:
        s.client.completions.create(model=s.model, prompt="no room", max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "capacity_exhausted"
    assert e.value.response.headers["Retry-After"] == "1" and "Deprecation" in e.value.response.headers
    for stream in streams:
        stream.close()
    wait_no_sessions(s.runtime)
    # greedy: this model never picks EOS greedily (a sampled token may be EOS)
    assert s.client.completions.create(model=s.model, prompt="room again", max_tokens=2,
                                       temperature=0).usage.completion_tokens == 2


# -- tokenizer requirements --------------------------------------------------------------
def _bare_shim_cfg(model_dir):
    return ServeConfig(bind="127.0.0.1:0", model=str(model_dir), http_port=free_port())


def test_model_without_tokenizer_refuses_to_start():
    d = text_model_dir(tokenizer=False)
    rt = Runtime(make_engine(model_path=str(d)))
    with pytest.raises(ConfigError, match="no tokenizer"):
        start_http_shim(rt, _bare_shim_cfg(d))


def test_tokenizer_of_another_model_refuses_to_start(tmp_path):
    import shutil

    # A 128-token model directory carrying the 259-token tokenizer of another model.
    d = make_tiny_model("llama", tmp_path / "mismatched", vocab_size=128)
    for f in text_model_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, d / f.name)
    rt = Runtime(make_engine(model_path=str(d)))
    with pytest.raises(ConfigError, match="do not belong together"):
        start_http_shim(rt, _bare_shim_cfg(d))


def test_model_without_chat_template_serves_completions_only():
    d = text_model_dir(chat_template=False)
    rt = Runtime(make_engine(model_path=str(d)))
    cfg = _bare_shim_cfg(d)
    stop = start_http_shim(rt, cfg)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cfg.http_port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2)
        assert e.value.code == "chat_template_missing" and "/v1/completions" in e.value.message
        assert client.completions.create(model="tiny-llama", prompt="raw", max_tokens=2).usage.completion_tokens >= 1
        wait_no_sessions(rt)
    finally:
        stop()


# -- text plumbing -----------------------------------------------------------------------
def test_incremental_detokenizer_never_splits_characters():
    tok = tokenizer_of(text_model_dir())
    text = "héllo € 😀 naïve ☃ end"
    ids = tok.encode(text)  # byte-level: multi-byte characters span several ids
    d = IncrementalDecoder(tok)
    pieces = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some ids completed no character
    # a truncated character at the end still comes out (as U+FFFD) on flush
    d = IncrementalDecoder(tok)
    out = "".join(d.push(i) for i in tok.encode("ok €")[:-1]) + d.flush()
    assert out.startswith("ok ") and out.endswith("\ufffd")


def test_stop_matcher_across_pieces():
    m = StopMatcher(["END", "xyz"])
    assert [m.feed(p) for p in ["abc E", "N", "D tail"]] == ["abc ", "", ""] and m.hit
    m = StopMatcher(["END"])
    assert [m.feed(p) for p in ["aE", "Nb"]] == ["a", "ENb"] and not m.hit and m.flush() == ""
    m = StopMatcher(["END"])
    assert m.feed("xxEN") == "xx" and m.flush() == "EN"


# -- the real model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    d = require_smollm2()
    s = Shim(d, window=1020)
    yield s
    s.stop()


@pytest.mark.model
def test_real_model_chat_and_stream(smol):
    kw = dict(model=smol.model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, temperature=0)
    r = smol.client.chat.completions.create(**kw)
    assert "Paris" in r.choices[0].message.content
    tok = tokenizer_of(require_smollm2())
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(kw["messages"], tokenize=True, add_generation_prompt=True)["input_ids"])
    streamed = "".join(c.choices[0].delta.content or "" for c in smol.client.chat.completions.create(stream=True, **kw))
    assert streamed == r.choices[0].message.content
    wait_no_sessions(smol.runtime)


@pytest.mark.model
def test_real_model_completion_with_stop(smol):
    kw = dict(model="smollm2-135m-instruct", prompt="The days of the week are Monday, Tuesday,", max_tokens=16, temperature=0)
    text = smol.client.completions.create(**kw).choices[0].text
    assert "Wednesday" in text
    r = smol.client.completions.create(stop="Wednesday", **kw)
    assert r.choices[0].text == text[: text.find("Wednesday")] and r.choices[0].finish_reason == "stop"
    wait_no_sessions(smol.runtime)
