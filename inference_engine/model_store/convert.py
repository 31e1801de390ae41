"""Dequantize a GGUF causal LM into a float32 safetensors HF directory, and check the copy.

transformers loads the GGUF (dequantizing every tensor) but refuses to `save_pretrained`
such a model, so its state dict is loaded into a plain model built from the same config,
which saves normally. The copy is then reloaded from disk and must reproduce the GGUF
model's logits on a probe prompt: that, not a file listing, is what "verified" means.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import PullError

# Nothing here may reach a model hub: every load is from a local file or directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROBE_USER_MESSAGE = "What is the capital of France? Answer in one word."
PROBE_PLAIN_TEXT = "The capital of France is"
# Text whose tokenization must round-trip exactly (digits, punctuation, unicode, spaces).
ROUNDTRIP_TEXT = "Passkey 40213, naïve café — ok?\n  indented\tline"
# Both sides run the same float32 weights through the same code, so only kernel-order
# noise separates them.
LOGIT_ATOL = 1e-3


@dataclass
class TokenizerInfo:
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    chat_template: bool


@dataclass
class ConversionReport:
    architecture: str
    model_type: str
    num_parameters: int
    tokenizer: TokenizerInfo
    probe_tokens: int
    max_abs_logit_diff: float
    greedy_next_token: str


def _probe_ids(tokenizer) -> list[int]:
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROBE_USER_MESSAGE}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(PROBE_PLAIN_TEXT)["input_ids"]


def _eos_ids(*values) -> list[int]:
    ids: list[int] = []
    for v in values:
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


def tokenizer_info(tokenizer, model) -> TokenizerInfo:
    gen = getattr(model, "generation_config", None)
    return TokenizerInfo(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=_eos_ids(tokenizer.eos_token_id, model.config.eos_token_id, getattr(gen, "eos_token_id", None)),
        pad_token_id=tokenizer.pad_token_id,
        chat_template=bool(tokenizer.chat_template),
    )


def _probe_logits(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # (T, V)


def convert_gguf(gguf_path: Path, out: Path, *, progress: bool = True) -> ConversionReport:
    """Write a float32 HF model directory for `gguf_path` into `out` and verify it."""
    with _quiet_transformers(not progress):
        return _convert(gguf_path, out)


@contextlib.contextmanager
def _quiet_transformers(quiet: bool):
    """Silence transformers' bars: its own switch misses the GGUF dequantization bar."""
    from transformers.utils import logging as hf_logging

    if not quiet:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bars_were_on = hf_logging.is_progress_bar_enabled()
    original_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if original_tqdm is not None:
        # a silenced stand-in for the module's tqdm class, restored below
        gguf_utils.tqdm = functools.partial(original_tqdm, disable=True)  # type: ignore[assignment]
    try:
        yield
    finally:
        if original_tqdm is not None:
            gguf_utils.tqdm = original_tqdm
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _convert(gguf_path: Path, out: Path) -> ConversionReport:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_file, dtype=torch.float32, local_files_only=True
        )
    except Exception as exc:  # noqa: BLE001 - re-raised with the file and the fix named
        raise PullError(
            f"transformers could not load {gguf_path} ({type(exc).__name__}: {exc}); "
            "loading GGUF needs transformers>=5 with the `gguf` and `accelerate` packages installed "
            "and an architecture transformers supports for GGUF"
        ) from exc
    gguf_model.eval()
    probe = _probe_ids(tokenizer)
    reference = _probe_logits(gguf_model, probe)

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise PullError(
            f"the dequantized weights of {gguf_path.name} do not fit a {type(model).__name__} built from "
            f"its own config (missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]})"
        )
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    del gguf_model
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # GGUF tokenizers come with an unbounded model_max_length; the context length is the bound.
    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(out)
    del model
    return verify_against_reference(out, probe, reference, tokenizer)


def verify_against_reference(model_dir: Path, probe: list[int], reference, source_tokenizer) -> ConversionReport:
    """Reload `model_dir` from disk; its tokenizer and logits must match the source's."""
    import torch

    model, tokenizer = load_for_check(model_dir)
    if _probe_ids(tokenizer) != probe:
        raise PullError(f"the tokenizer saved in {model_dir} tokenizes the probe prompt differently from the GGUF's")
    ids = tokenizer(ROUNDTRIP_TEXT, add_special_tokens=False)["input_ids"]
    if tokenizer.decode(ids) != ROUNDTRIP_TEXT or ids != source_tokenizer(ROUNDTRIP_TEXT, add_special_tokens=False)["input_ids"]:
        raise PullError(f"the tokenizer saved in {model_dir} does not round-trip {ROUNDTRIP_TEXT!r} like the GGUF's")
    logits = _probe_logits(model, probe)
    if not torch.isfinite(logits).all():
        raise PullError(f"the model saved in {model_dir} produces non-finite logits on the probe prompt")
    diff = float((logits - reference).abs().max())
    if not diff <= LOGIT_ATOL:
        raise PullError(
            f"the model saved in {model_dir} differs from the GGUF model it came from "
            f"(max |logit diff| {diff:.3g} > {LOGIT_ATOL}); the conversion is wrong for this architecture"
        )
    return ConversionReport(
        architecture=type(model).__name__,
        model_type=model.config.model_type,
        num_parameters=sum(p.numel() for p in model.parameters()),
        tokenizer=tokenizer_info(tokenizer, model),
        probe_tokens=len(probe),
        max_abs_logit_diff=diff,
        greedy_next_token=tokenizer.decode([int(logits[-1].argmax())]),
    )


def load_for_check(model_dir: Path):
    """(model, tokenizer) of a local HF directory, float32, eval mode, never touching a hub."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return model.eval(), tokenizer
