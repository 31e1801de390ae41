"""Passkey (needle-in-a-haystack) recall ladder through the real gRPC server and Python SDK.

Tasks (--task; one per run, recorded in the JSON and in the default file names):
  passkey    a filler document with one needle sentence carrying a random 5-digit passkey at a
             random depth, then the question;
  multikey   --keys needles, each a different labelled key ("the pass key for the red door is
             ..."), at random depths; the question asks for one label (the others are distractors;
             rows record whether the answer gave a distractor's key);
  multiturn  turn 1 is the passkey document without its question; then --turns turns, each
             appending unrelated text and generating --turn-tokens tokens (they join the history);
             then the question in a last turn.
Greedy decoding; recall = the asked key appears in the final answer. Rungs are total prompt
lengths in tokens (multiturn: the history when the question is asked, generated tokens included). Arms are server
configurations (KV strategy, window, compressor, restoration). Per arm and rung we record
recall, resident KV bytes, process peak RSS during the rung, time to first token, decode
tokens/s and the effective attention fraction (positions a decode query attends / history).
A run writes one part (results/research/parts/niah_ladder_part_<date>.json and .png by default);
--merge joins parts into results/research/niah_ladder.json and .png, each cell carrying the
provenance (commit, dirty flag, device, machine, date) of the part(s) it came from. Notes on the
results are prose in docs/research/niah_ladder_notes.md, which the merged JSON links.

The evaluation generator uses its own seed and templates (EVAL_*); anything trained on
retrieval data must use different ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_common import ROOT, PeakRSS, run_metadata, write_json  # noqa: E402

RESULTS = ROOT / "results" / "research"
MERGED = RESULTS / "niah_ladder.json"
PARTS = RESULTS / "parts"
NOTES_DOC = "docs/research/niah_ladder_notes.md"

EVAL_SEED = 20261122
DEV_SEED = 20261124  # --sample-set dev: other samples of the same generator, for choosing settings (not for reporting)
EVAL_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
              "I will quiz you about the important information there.\n")
EVAL_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
EVAL_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
EVAL_QUESTION = "\nWhat is the pass key? The pass key is"
# multikey: labels of the needles (a sample draws --keys of them); the question names one
EVAL_LABELS = ("the red door", "the blue box", "the green gate", "the silver safe", "the old locker", "the back office",
               "the garden shed", "the north tower")
EVAL_KEYED_NEEDLE = "The pass key for {label} is {key}. Remember it. {key} is the pass key for {label}. "
EVAL_KEYED_QUESTION = "\nWhat is the pass key for {label}? The pass key for {label} is"
# multiturn: the unrelated text each later turn appends (a different filler from the document's)
EVAL_TURN_TEXT = ("Here is an unrelated note. The library opens at nine. Traffic on the main road is light today. "
                  "The bakery sells bread and cakes. ")
TASKS = ("passkey", "multikey", "multiturn")

# name -> ServeConfig overrides. Arms whose strategy/compressor the build lacks are reported as not run.
ARMS = {
    "full": dict(kv_strategy="full"),
    "full+kakeya_e8": dict(kv_strategy="full", kv_compressor="kakeya_e8"),
    # q_range sweep: finer lattice, more bits per vector (bytes recorded per cell)
    "full+kakeya_e8_q76": dict(kv_strategy="full", kv_compressor="kakeya_e8", kv_q_range=76),
    "full+kakeya_e8_q152": dict(kv_strategy="full", kv_compressor="kakeya_e8", kv_q_range=152),
    "sink_window_4+64": dict(kv_strategy="sink_window", sink=4, window=64),
    "sink_window_4+1020": dict(kv_strategy="sink_window", sink=4, window=1020),
    "sink_window_4+1020+kakeya_e8": dict(kv_strategy="sink_window", sink=4, window=1020, kv_compressor="kakeya_e8"),
    "dlm_restore_same_4+64": dict(kv_strategy="dlm_restore", sink=4, window=64, restore_from="verifier"),
    "dlm_restore_same_4+64+kakeya_e8": dict(kv_strategy="dlm_restore", sink=4, window=64, restore_from="verifier",
                                            kv_compressor="kakeya_e8"),
    "dlm_restore_cross_4+64": dict(kv_strategy="dlm_restore", sink=4, window=64, restore_from="drafter", drafter="smollm2-135m-dlm",
                                   spec_k=0),
    "dlm_restore_cross_4+64+kakeya_e8": dict(kv_strategy="dlm_restore", sink=4, window=64, restore_from="drafter",
                                             drafter="smollm2-135m-dlm", spec_k=0, kv_compressor="kakeya_e8"),
    "sink_window_4+64+kakeya_e8": dict(kv_strategy="sink_window", sink=4, window=64, kv_compressor="kakeya_e8"),
    # cross-model + the 16 evicted positions f_θ restores worst kept resident (resident = 4 + 64 + 16 rows),
    # and the control with the same resident budget and no restoration
    "dlm_restore_cross_4+64+pin16": dict(kv_strategy="dlm_restore", sink=4, window=64, restore_from="drafter",
                                         drafter="smollm2-135m-dlm", spec_k=0, restore_pin=16),
    "dlm_restore_cross_4+64+pin16+kakeya_e8": dict(kv_strategy="dlm_restore", sink=4, window=64, restore_from="drafter",
                                                   drafter="smollm2-135m-dlm", spec_k=0, restore_pin=16, kv_compressor="kakeya_e8"),
    "dlm_restore_cross_4+64+pin64": dict(kv_strategy="dlm_restore", sink=4, window=64, restore_from="drafter",
                                         drafter="smollm2-135m-dlm", spec_k=0, restore_pin=64),
    # + f_θ's attention-mass calibration (scripts/training/calibrate_restore.py)
    "dlm_restore_cross_4+64+pin16+calibrated": dict(kv_strategy="dlm_restore", sink=4, window=64, restore_from="drafter",
                                                    drafter="smollm2-135m-dlm", spec_k=0, restore_pin=16, restore_bias="calibrated"),
    "sink_window_4+80": dict(kv_strategy="sink_window", sink=4, window=80),
    # the int8 resident K/V store (--kv-dtype int8); its gate: the same hits as fp32 K/V at every rung
    "full+kv_int8": dict(kv_strategy="full", kv_dtype="int8"),
    "sink_window_4+1020+kv_int8": dict(kv_strategy="sink_window", sink=4, window=1020, kv_dtype="int8"),
    # fp16 resident K/V (--kv-dtype fp16, what --kv-dtype auto picks on AVX2 CPUs)
    "full+kv_fp16": dict(kv_strategy="full", kv_dtype="fp16"),
    "sink_window_4+1020+kv_fp16": dict(kv_strategy="sink_window", sink=4, window=1020, kv_dtype="fp16"),
    # paged (issue 15): window 508 keeps resident + selection under sink_window 4+1020's bytes up to 7.5k (docs/paged.md)
    "paged_4+508_p64_m8": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8),
    # the same with fp16 K/V (--kv-dtype fp16: the slab and the page store in fp16)
    "paged_4+508_p64_m8+kv_fp16": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8,
                                       kv_dtype="fp16"),
    # the compact keys scored against the fp32 query (the choice before the int8 query, kv/paged_store.query_int8)
    "paged_4+508_p64_m8+q_fp32": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8,
                                      page_query="fp32"),
    "paged_4+508_p64_m8_s32": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8, page_shortlist=32,
                                   page_shortlist_from=0),
    "paged_4+508_p64_m8_s64": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8, page_shortlist=64,
                                   page_shortlist_from=0),
    # the shortlist from 128 candidate pages (the native step's measured crossover; the default before: 256)
    "paged_4+508_p64_m8_sf128": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8,
                                     page_shortlist_from=128),
    # InfLLM's layout from position 4096 instead of the trained context (docs/paged.md, "Where the InfLLM layout starts")
    "paged_4+508_p64_m8_far4k": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8,
                                     page_far_from=4096),
    # the same as the daemon runs paged (fp16 K/V): past the trained context it is, bit for bit, paged with
    # --page-far-from 4096 --page-far-after context (docs/paged.md, "far_from once past the context")
    "paged_4+508_p64_m8_far4k+kv_fp16": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8,
                                             page_far_from=4096, kv_dtype="fp16"),
    # the same with a query choosing its pages at every 4th position past the trained context, the others taking the
    # last choice's pages (--page-choice-every 4; under the context the same bits)
    "paged_4+508_p64_m8_far4k_ce4+kv_fp16": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8,
                                                 page_far_from=4096, kv_dtype="fp16", page_choice_every=4),
    # paged as the daemon runs it since 2026-12-01: far_from 4096 once past the trained context (--page-far-after
    # context): under it the default's bits, past it paged_4+508_p64_m8_far4k+kv_fp16's on these tasks
    "paged_4+508_p64_m8_far4k_ctx+kv_fp16": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8,
                                                 page_far_from=4096, page_far_after="context", kv_dtype="fp16"),
    # the same with the recalled pages spread (their gaps scaled to fit 4096 positions) instead of packed next to the
    # window (docs/paged.md, "The spread layout")
    "paged_4+508_p64_m8_far4k_spread": dict(kv_strategy="paged", sink=4, window=508, page_size=64, recall_pages=8,
                                            page_far_from=4096, page_far_layout="spread"),
    "paged_4+1020_p64_m8": dict(kv_strategy="paged", sink=4, window=1020, page_size=64, recall_pages=8),
    # the same 512 recalled rows in finer pages, and a narrower window with more recalled rows (chosen on --sample-set dev)
    "paged_4+508_p32_m16": dict(kv_strategy="paged", sink=4, window=508, page_size=32, recall_pages=16),
    "paged_4+508_p16_m32": dict(kv_strategy="paged", sink=4, window=508, page_size=16, recall_pages=32),
    "paged_4+252_p64_m12": dict(kv_strategy="paged", sink=4, window=252, page_size=64, recall_pages=12),
}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One ladder sample: turns of (token ids appended, tokens generated after them); the last turn
    asks the question, and `key` must appear in its answer. `distractors`: the other keys (multikey)."""
    turns: tuple
    key: str
    depth: float
    distractors: tuple = ()

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.turns)

    @property
    def single_turn_ids(self) -> list:
        if len(self.turns) != 1:
            raise ValueError("a multi-turn sample has no single prompt")
        return self.turns[0][0]


def sample_rng(task: str, n_tokens: int, i: int, seed: int = EVAL_SEED) -> random.Random:
    """The generator of sample i of a rung: every script that rebuilds a ladder sample draws it here
    (passkey keeps its original seeds, so its sample i is the same in every part and script)."""
    return random.Random(seed * 1000 + n_tokens * 100 + i + TASKS.index(task) * 10**7)


def make_sample(tok, n_tokens: int, rng: random.Random):
    """Token ids of a passkey document of about n_tokens tokens, the key, and the needle depth.

    Plain text (no chat template): SmolLM2-135M-Instruct retrieves reliably in this format
    with full attention (4/4 at ~1k tokens when the harness was written), and it keeps the
    ladder about the KV cache rather than about template following."""
    key = str(rng.randint(10000, 99999))
    needle = EVAL_NEEDLE.format(key=key)
    per_filler = len(tok(EVAL_FILLER * 8, add_special_tokens=False)["input_ids"]) / 8
    overhead = len(tok(EVAL_INTRO + needle + EVAL_QUESTION, add_special_tokens=False)["input_ids"])
    reps = max(1, int((n_tokens - overhead) / per_filler))
    k = rng.randint(0, reps)
    ids = tok(EVAL_INTRO + EVAL_FILLER * k + needle + EVAL_FILLER * (reps - k) + EVAL_QUESTION, add_special_tokens=False)["input_ids"]
    return ids, key, k / reps


def _per_filler(tok, text: str) -> float:
    return len(tok(text * 8, add_special_tokens=False)["input_ids"]) / 8


def make_multikey_sample(tok, n_tokens: int, rng: random.Random, keys: int, answer_tokens: int) -> Sample:
    """`keys` labelled needles with distinct keys at distinct random depths; the question asks one label."""
    labels = rng.sample(EVAL_LABELS, keys)
    values = []
    while len(values) < keys:
        v = str(rng.randint(10000, 99999))
        values += [v] if v not in values else []
    asked = rng.randrange(keys)
    needles = [EVAL_KEYED_NEEDLE.format(label=lab, key=v) for lab, v in zip(labels, values)]
    question = EVAL_KEYED_QUESTION.format(label=labels[asked])
    overhead = len(tok(EVAL_INTRO + "".join(needles) + question, add_special_tokens=False)["input_ids"])
    reps = max(keys, int((n_tokens - overhead) / _per_filler(tok, EVAL_FILLER)))
    at = sorted(rng.sample(range(reps + 1), keys))  # filler repetitions before each needle
    order = list(range(keys))
    rng.shuffle(order)  # which needle goes where
    text, prev = EVAL_INTRO, 0
    for slot, i in zip(at, order):
        text += EVAL_FILLER * (slot - prev) + needles[i]
        prev = slot
    text += EVAL_FILLER * (reps - prev) + question
    ids = tok(text, add_special_tokens=False)["input_ids"]
    depth = at[order.index(asked)] / reps
    return Sample(((ids, answer_tokens),), values[asked], depth, tuple(v for i, v in enumerate(values) if i != asked))


def make_multiturn_sample(tok, n_tokens: int, rng: random.Random, turns: int, turn_tokens: int, answer_tokens: int) -> Sample:
    """Turn 1: the passkey document (half the rung) without its question; then `turns` turns of unrelated
    text (the rest of the rung, split evenly), each followed by `turn_tokens` generated tokens; then the
    question. The history at the question is about `n_tokens` long, generated tokens included."""
    key = str(rng.randint(10000, 99999))
    needle = EVAL_NEEDLE.format(key=key)
    doc_tokens = n_tokens // 2
    overhead = len(tok(EVAL_INTRO + needle, add_special_tokens=False)["input_ids"])
    reps = max(1, int((doc_tokens - overhead) / _per_filler(tok, EVAL_FILLER)))
    k = rng.randint(0, reps)
    doc = tok(EVAL_INTRO + EVAL_FILLER * k + needle + EVAL_FILLER * (reps - k), add_special_tokens=False)["input_ids"]
    question = tok(EVAL_QUESTION, add_special_tokens=False)["input_ids"]
    budget = n_tokens - len(doc) - len(question) - (turns + 1) * turn_tokens  # the generated tokens join the history
    per_turn = max(1, round(budget / turns / _per_filler(tok, EVAL_TURN_TEXT)))
    note = tok("\n" + EVAL_TURN_TEXT * per_turn, add_special_tokens=False)["input_ids"]
    return Sample(((doc, turn_tokens),) + ((note, turn_tokens),) * turns + ((question, answer_tokens),), key, k / reps)


def make_task_sample(task: str, tok, n_tokens: int, rng: random.Random, args) -> Sample:
    if task == "passkey":
        ids, key, depth = make_sample(tok, n_tokens, rng)
        return Sample(((ids, args.answer_tokens),), key, depth)
    if task == "multikey":
        return make_multikey_sample(tok, n_tokens, rng, args.keys, args.answer_tokens)
    if task == "multiturn":
        return make_multiturn_sample(tok, n_tokens, rng, args.turns, args.turn_tokens, args.answer_tokens)
    raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")


def run_sample(client, sample: Sample, piece: int):
    """Play the sample's turns in one session, each turn's tokens in appends of at most `piece` (the server's
    --max-append-tokens: a 32k prompt goes in pieces); (final answer token ids, last result, session info)."""
    with client.create_session() as s:
        for ids, n_gen in sample.turns:
            for i in range(0, len(ids), piece):
                s.append(ids[i:i + piece])
            toks = list(s.generate(max_tokens=n_gen))
        return toks, s.last_result, s.info()


FIDELITY_SCOPE = ("the proposer's K/V at every position a decode step after the prompt evicts, [sink, n - window], "
                  "against the verifier's own; --restore-pin positions are included (the runtime attends them exactly), "
                  "so for pinned arms this is f_θ's error, not the error the verifier sees")


def restore_fidelity(model, source, samples, sink: int, window: int) -> dict:
    """Per-layer relative MSE of the restored K and V against the verifier's own (pre-RoPE) K/V at the
    positions a decode step after the prompt restores: [sink, n - window]."""
    import torch

    from kv_cache_proposer.training.restore_data import rel_mse, verifier_kv

    s = model.spec
    kv_dim = s.num_kv_heads * s.head_dim
    ks, vs = torch.zeros(s.num_layers), torch.zeros(s.num_layers)
    for ids in (x.single_turn_ids for x in samples):
        hist = torch.tensor(ids)
        evicted = torch.arange(sink, len(ids) - window + 1)
        true = verifier_kv(model, hist[: int(evicted[-1]) + 1])[:, sink:]
        step = source.open_step(hist, evicted)
        got = []
        for layer in range(s.num_layers):
            k, v = step.kv_for_layer(layer)
            got.append(torch.cat([k.transpose(0, 1).reshape(evicted.numel(), -1), v.transpose(0, 1).reshape(evicted.numel(), -1)], -1))
        step.close()
        rk, rv = rel_mse(torch.stack(got).float().cpu(), true.float().cpu(), kv_dim)
        ks += rk / len(samples)
        vs += rv / len(samples)
    return {"samples": len(samples), "scope": FIDELITY_SCOPE, "k_rel_mse_mean": float(ks.mean()), "v_rel_mse_mean": float(vs.mean()),
            "k_rel_mse_per_layer": [round(float(x), 4) for x in ks], "v_rel_mse_per_layer": [round(float(x), 4) for x in vs]}


def attention_fraction(arm_cfg, history: int) -> float:
    if arm_cfg.kv_strategy in ("full", "dlm_restore"):
        return 1.0  # dlm_restore attends resident + restored = every position
    return min(1.0, (arm_cfg.sink + arm_cfg.resolved_window) / history)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--rungs", default="1000,2000,4000,7500")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--sample-set", default="eval", choices=("eval", "dev"),
                    help="eval: the reported samples; dev: samples from another seed, for choosing settings without "
                         "looking at the eval samples")
    ap.add_argument("--first-sample", type=int, default=0,
                    help="run samples FIRST .. FIRST+SAMPLES-1 of each rung (a continuation of a cut-off cell; --merge joins it "
                         "to the cell holding samples 0 .. FIRST-1 on the same device)")
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--task", default="passkey", choices=TASKS)
    ap.add_argument("--keys", type=int, default=4, help="multikey: needles per sample")
    ap.add_argument("--turns", type=int, default=10, help="multiturn: turns of unrelated text between the needle and the question")
    ap.add_argument("--turn-tokens", type=int, default=8, help="multiturn: tokens generated after each earlier turn")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="torch device of the server's model and proposer: cpu or cuda")
    ap.add_argument("--max-seconds-per-arm-rung", type=float, default=0, help="stop a cell early (recorded) after this long; 0 = never")
    ap.add_argument("--arm-seconds", default="", help="per-arm cell time limits overriding the default: ARM=SECONDS,...")
    ap.add_argument("--skip", default="", help="cells not run (recorded as skipped): ARM@RUNG,...")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--fidelity-samples", type=int, default=1,
                    help="cross-model arms: samples per rung whose restored K/V are compared with the verifier's (per-layer rel-MSE)")
    ap.add_argument("--out", default="", help=f"default: a run writes {PARTS.relative_to(ROOT)}/niah_ladder_part_<UTC date>.json, "
                                                f"--merge writes {MERGED.relative_to(ROOT)}")
    ap.add_argument("--merge", default="", help="only combine these ladder part JSONs (comma-separated) into --out")
    ap.add_argument("--merge-first-sample", type=int, default=0,
                    help="with --merge: cells starting at this sample begin a sample set (a pre-registered re-run on "
                         "samples never run before, e.g. 40), later ones continue them")
    ap.add_argument("--profiles", default="",
                    help="with --merge: profile_restore.py JSONs (comma-separated) whose per-rung decode-step time split "
                         "(proposer open / per-layer / f_θ trunk, attention, decompress, other; CPU seconds) is copied in")
    args = ap.parse_args()
    suffix = "" if args.task == "passkey" else f"_{args.task}"
    if args.merge:
        return merge(args.merge.split(","), args.out or MERGED.with_name(f"niah_ladder{suffix}.json"),
                     [p for p in args.profiles.split(",") if p], args.merge_first_sample)
    args.out = args.out or str(PARTS / time.strftime(f"niah_ladder{suffix}_part_%Y%m%dT%H%M%SZ.json", time.gmtime()))

    import torch
    from transformers import AutoTokenizer

    import kakeya
    from inference_engine.model_store import resolve_model
    from inference_engine.kv import paged_store
    from inference_engine.kv.registry import research_options
    from inference_engine.server.app import ServeConfig, build_runtime, load_model, start

    torch.set_num_threads(args.threads)
    base = ServeConfig(bind="127.0.0.1:0", model=args.model, threads=args.threads, capacity=2, prefill_chunk=args.prefill_chunk,
                       persist="off",  # research sessions: nothing to keep, and the user's state directory stays free
                       device=args.device,
                       kv_dtype="fp32")  # an arm's K/V as recorded before --kv-dtype auto; +kv_* arms set their own
    arm_seconds = {a: float(s) for a, s in (x.split("=") for x in args.arm_seconds.split(",") if x)}
    skip = set(x for x in args.skip.split(",") if x)
    model = load_model(base)
    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    rungs = [int(r) for r in args.rungs.split(",")]
    seed = EVAL_SEED if args.sample_set == "eval" else DEV_SEED
    samples = {n: [make_task_sample(args.task, tok, n, sample_rng(args.task, n, i, seed), args)
                   for i in range(args.first_sample, args.first_sample + args.samples)] for n in rungs}
    results = {}
    # Metadata taken at the start (load average before the run); the JSON is rewritten after every cell,
    # so a run that is cut off keeps what it measured ("complete": false until the end).
    meta = run_metadata(vars(args) | {"accelerator": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                                      "eval_seed": EVAL_SEED, "filler": EVAL_FILLER, "needle": EVAL_NEEDLE, "question": EVAL_QUESTION,
                                      "task": args.task, "sample_seed": seed}
                        | ({"labels": EVAL_LABELS, "keyed_needle": EVAL_KEYED_NEEDLE, "keyed_question": EVAL_KEYED_QUESTION}
                           if args.task == "multikey" else {})
                        | ({"turn_text": EVAL_TURN_TEXT} if args.task == "multiturn" else {}))
    for arm in args.arms.split(","):
        fields = {f.name for f in dataclasses.fields(ServeConfig)}
        research_fields = set(research_options())
        overrides = ARMS[arm]
        # page_query: a process switch, not a ServeConfig field (set for this arm, back to the default after)
        paged_store.query_int8(overrides.get("page_query", "int8") == "int8")
        product = {k: v for k, v in overrides.items() if k not in research_fields and k != "page_query"}
        if product.get("kv_strategy") == "paged":  # an arm names its layout: without a far_from, the trained context's
            product.setdefault("page_far_from", 0)  # (every paged arm's before paged's default far_from, 2026-12-01)
            product.setdefault("page_choice_every", 1)  # and its choice: every query's (the default before 2026-12-01's N = 4)
        research = {k: v for k, v in overrides.items() if k in research_fields}
        missing = sorted(set(product) - fields)
        if missing:
            results[arm] = {"status": "not_run", "reason": f"this build has no {', '.join(missing)} option"}
            print(f"{arm}: not run ({results[arm]['reason']})", flush=True)
            continue
        cfg = dataclasses.replace(base, **product, research=research)
        try:
            server = start(cfg, build_runtime(cfg, model))
        except Exception as e:  # noqa: BLE001 - an arm the build cannot serve is recorded, not fatal
            results[arm] = {"status": "not_run", "reason": f"{type(e).__name__}: {e}"}
            print(f"{arm}: not run ({results[arm]['reason']})", flush=True)
            continue
        results[arm] = {"status": "ok", "config": overrides, "rungs": {}}
        limit = arm_seconds.get(arm, args.max_seconds_per_arm_rung)
        with kakeya.Client(f"127.0.0.1:{server.port}") as client:
            for n in rungs:
                if f"{arm}@{n}" in skip:
                    results[arm]["rungs"][str(n)] = {"status": "skipped", "reason": "--skip"}
                    print(f"{arm} @ {n}: skipped", flush=True)
                    continue
                limit_tokens = server.runtime.engine.history_limit()  # full: the trained context; None: no limit
                longest = max(smp.prompt_tokens + sum(g for _, g in smp.turns) for smp in samples[n])
                if limit_tokens is not None and longest > limit_tokens:
                    results[arm]["rungs"][str(n)] = {"status": "skipped",
                                                     "reason": f"past this arm's history limit of {limit_tokens} tokens"}
                    print(f"{arm} @ {n}: skipped (history limit {limit_tokens})", flush=True)
                    continue
                hits, ttfts, rates, kv_bytes, tiers, rows = 0, [], [], [], [], []
                if args.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                t_cell = time.perf_counter()
                with PeakRSS() as mem:
                    for i, smp in enumerate(samples[n], start=args.first_sample):
                        toks, r, info = run_sample(client, smp, cfg.max_append_tokens)
                        kv_bytes.append(info.kv_live_bytes)
                        tiers.append((info.kv_resident_bytes, info.kv_selection_bytes, info.kv_stored_bytes, info.kv_cold_bytes))
                        answer = tok.decode(toks, skip_special_tokens=True)
                        key, depth = smp.key, smp.depth
                        hit = key in answer
                        hits += hit
                        ttfts.append(r.time_to_first_token_seconds)
                        dec = r.total_seconds - r.time_to_first_token_seconds
                        rates.append((r.generated_tokens - 1) / dec if r.generated_tokens > 1 and dec > 0 else 0.0)
                        rows.append({"sample": i, "key": key, "depth": round(depth, 3), "hit": hit, "answer": answer,
                                     "prompt_tokens": smp.prompt_tokens, "ttft_s": ttfts[-1], "decode_tok_s": rates[-1]}
                                    | ({"distractor_answered": any(d in answer for d in smp.distractors)} if smp.distractors else {})
                                    | ({"turns": len(smp.turns), "history_tokens": info.history_length} if len(smp.turns) > 1 else {}))
                        if limit and time.perf_counter() - t_cell > limit:
                            break
                done = len(rows)
                cell = {
                    "samples": done,
                    "recall": hits / done,
                    "kv_live_bytes_max": max(kv_bytes),
                    # the tiers (GetSessionInfo): hot set, page-selection data, page store in RAM, on disk (spill files)
                    "kv_resident_bytes_max": max(t[0] for t in tiers),
                    "kv_selection_bytes_max": max(t[1] for t in tiers),
                    "kv_stored_bytes_max": max(t[2] for t in tiers),
                    "kv_cold_bytes_max": max(t[3] for t in tiers),
                    "peak_rss_bytes": mem.peak,  # host memory of the process (server and harness)
                    **({"peak_accelerator_bytes": torch.cuda.max_memory_allocated()} if args.device.startswith("cuda") else {}),
                    "ttft_s_median": sorted(ttfts)[done // 2],
                    "decode_tok_s_median": sorted(rates)[done // 2],
                    "attention_fraction": attention_fraction(cfg, n),
                    "device": cell_device(meta),
                    "seconds": time.perf_counter() - t_cell,
                    "time_limit_s": limit,
                    "rows": rows,
                }
                source = getattr(server.runtime.engine, "strategy_resources", None)
                if source is not None and args.fidelity_samples and args.task != "multiturn":  # not timed: after the cell
                    cell["restore_fidelity"] = restore_fidelity(model, source, samples[n][: args.fidelity_samples], cfg.sink,
                                                                cfg.resolved_window)
                    f = cell["restore_fidelity"]
                    print(f"    restored K/V vs verifier: K rel-MSE {f['k_rel_mse_mean']:.3f}  V {f['v_rel_mse_mean']:.3f}", flush=True)
                results[arm]["rungs"][str(n)] = cell
                write_json(pathlib.Path(args.out), meta | {"complete": False, "arms": results, "vs_full": vs_full(results)})
                print(f"{arm} @ {n}: recall {hits}/{done}  kv {cell['kv_live_bytes_max'] / 1e6:.1f} MB  ttft {cell['ttft_s_median']:.2f}s  "
                      f"decode {cell['decode_tok_s_median']:.1f} tok/s  ({cell['seconds']:.0f}s)", flush=True)
        server.stop()

    finish(pathlib.Path(args.out), meta, results)
    return 0


def cell_device(meta: dict) -> str:
    """Where a part's cells ran: 'cpu' or the accelerator's name. Parts from before --device record no device; a
    CPU-only torch build ('+cpu') says they ran on the CPU, anything else is 'unknown'."""
    cfg = meta.get("config", {})
    if cfg.get("accelerator") or cfg.get("device"):
        return cfg.get("accelerator") or cfg["device"]
    return "cpu" if str(meta.get("machine", {}).get("torch", "")).endswith("+cpu") else "unknown"


def part_provenance(path: str, meta: dict) -> dict:
    """Where and from what code a part's cells came; a field the part does not record is 'unknown'."""
    machine = meta.get("machine") or {}
    return {"part": path, "commit": meta.get("commit") or "unknown", "dirty_worktree": meta.get("dirty_worktree", "unknown"),
            "device": cell_device(meta), "machine": machine.get("platform", "unknown"), "date_utc": meta.get("date_utc", "unknown")}


def vs_full(results: dict, full_by_device: dict | None = None) -> dict:
    """Per arm and rung: recall minus full's (all samples, and on the samples both ran) and decode speed over full's.

    Decode speed is compared only with a `full` cell measured on the same device (`full_by_device`:
    device -> rung -> cell; by default the results' own `full`), and, for an arm with a compressor,
    also with `full` + that compressor on the same device."""
    ratios = {}
    if full_by_device is None:
        full_by_device = {}
        if results.get("full", {}).get("status") == "ok":
            for n, c in results["full"]["rungs"].items():
                full_by_device.setdefault(c.get("device", "cpu"), {})[n] = c
    comp_by_device = {}
    for arm, r in results.items():
        comp = r.get("config", {}).get("kv_compressor") if r.get("status") == "ok" else None
        if arm.startswith("full+") and comp and "kv_q_range" not in r["config"]:
            for n, c in r["rungs"].items():
                if "recall" in c:
                    comp_by_device.setdefault((comp, c.get("device", "cpu")), {})[n] = c
    for arm, r in results.items():
        if r.get("status") != "ok":
            continue
        ratios[arm] = {}
        comp = r.get("config", {}).get("kv_compressor")
        for n, c in r["rungs"].items():
            dev = c.get("device", "cpu")
            full = full_by_device.get(dev, {}).get(n)
            if "recall" not in c or full is None or "recall" not in full:
                continue
            common = min(c["samples"], full["samples"])  # every arm runs the same samples in the same order
            cell = {
                "device": dev,
                "recall_minus_full": c["recall"] - full["recall"],
                "common_samples": common,
                "recall_minus_full_on_common_samples": (sum(x["hit"] for x in c["rows"][:common])
                                                        - sum(x["hit"] for x in full["rows"][:common])) / common,
                "decode_tok_s_over_full": c["decode_tok_s_median"] / max(1e-9, full["decode_tok_s_median"]),
            }
            same = comp_by_device.get((comp, dev), {}).get(n) if comp else None
            if same is not None:
                cell["decode_tok_s_over_full_same_compressor"] = c["decode_tok_s_median"] / max(1e-9, same["decode_tok_s_median"])
            ratios[arm][n] = cell
    return ratios


def leading_digits(key: str, answer: str) -> int:
    """How many of the passkey's digits the answer reproduces, in order, before its first wrong character."""
    n = 0
    for want, got in zip(key, answer.strip()):
        if want != got:
            break
        n += 1
    return n


def add_partial_recall(results: dict) -> None:
    """Per cell, read off the rows: `first_digit_recall` (the answer starts with the key's first digit: the needle
    was found) next to `recall` (all five digits copied). Separates finding the needle from copying it."""
    for r in results.values():
        for c in r.get("rungs", {}).values() if r.get("status") == "ok" else ():
            if c.get("rows"):
                lead = [leading_digits(x["key"], x["answer"]) for x in c["rows"]]
                c["first_digit_recall"] = sum(n >= 1 for n in lead) / len(lead)
                c["leading_digits_mean"] = sum(lead) / len(lead)


def finish(out, meta: dict, results: dict, full_by_device: dict | None = None) -> None:
    add_partial_recall(results)
    write_json(out, meta | {"complete": True, "arms": results, "vs_full": vs_full(results, full_by_device)})
    plot(results, out.with_suffix(".png"))


def targets(results: dict, ratios: dict) -> dict:
    """The issue's ladder targets, read off the merged cells: per arm and rung, the recall difference
    (percentage points) the target is about and whether it holds; `samples` says how many samples
    the cell has (the ladder asks for >= 20)."""
    out = {}
    rules = {  # arm prefix -> (target, allowed shortfall in points); arms without a compressor
        "dlm_restore_same": ("same-model recall == full recall (delta = 0)", 0.0),
        "dlm_restore_cross": ("criterion 1a: cross-model recall >= full recall - 5 points", 5.0),
        "paged": ("issue 15: paged recall >= full recall - 5 points", 5.0),
    }
    for arm, per_rung in ratios.items():
        rule = next((r for prefix, r in rules.items() if arm.startswith(prefix)), None)
        if rule is None or "kakeya" in arm:
            continue
        cells = {}
        for n, c in sorted(per_rung.items(), key=lambda kv: int(kv[0])):
            delta = 100 * c["recall_minus_full"]
            cells[n] = {"recall_minus_full_points": round(delta, 1), "samples": results[arm]["rungs"][n]["samples"],
                        "met": delta >= -rule[1] - 1e-9}
        out[arm] = {"target": rule[0], "rungs": cells, "met_at_every_rung": all(c["met"] for c in cells.values())}
    for arm, r in results.items():  # KakeyaLattice on: recall within 1 point of the same arm without it
        base = arm.replace("+kakeya_e8", "").replace("+kakeya_d4", "")
        if r.get("status") != "ok" or base == arm or "kv_q_range" in r.get("config", {}) or base not in results:
            continue
        cells = {}
        for n, c in sorted(r["rungs"].items(), key=lambda kv: int(kv[0])):
            off = results[base]["rungs"].get(n, {})
            if "recall" not in c or "recall" not in off:
                continue
            common = min(c["samples"], off["samples"])  # the same samples in the same order: compare those
            delta = 100 * (sum(x["hit"] for x in c["rows"][:common]) - sum(x["hit"] for x in off["rows"][:common])) / common
            cells[n] = {"recall_minus_off_points": round(delta, 1), "samples": [c["samples"], off["samples"]],
                        "common_samples": common, "met": abs(delta) <= 1.0 + 1e-9}
        out[arm] = {"target": f"KakeyaLattice on: recall within 1 point of {base}", "rungs": cells,
                    "met_at_every_rung": all(c["met"] for c in cells.values())}
    return out


def first_sample(cell: dict) -> int:
    """Index of a cell's first sample (rows from before --first-sample carry no index: they start at 0)."""
    return cell["rows"][0].get("sample", 0) if cell.get("rows") else 0


def join_cells(a: dict, b: dict) -> dict:
    """Cell `b` (samples first .. first+m-1 of a rung) appended to cell `a` (samples 0 .. first-1, same arm and device)."""
    rows = [dict(x, sample=x.get("sample", i)) for i, x in enumerate(a["rows"])] + b["rows"]
    done = len(rows)
    cell = {k: v for k, v in a.items() if k not in ("rows", "provenance", "time_limit_s")}
    cell |= {
        "samples": done, "recall": sum(x["hit"] for x in rows) / done,
        "kv_live_bytes_max": max(a["kv_live_bytes_max"], b["kv_live_bytes_max"]),
        "peak_rss_bytes": max(a["peak_rss_bytes"], b["peak_rss_bytes"]),
        "seconds": a["seconds"] + b["seconds"],
        "provenance": a["provenance"] + b["provenance"],  # one entry per part, each naming its samples
        "time_limit_s": (a["time_limit_s"] if len(a["provenance"]) > 1 else [a.get("time_limit_s")]) + [b.get("time_limit_s")],
        "rows": rows,
    }
    for tier in ("kv_resident_bytes_max", "kv_selection_bytes_max", "kv_stored_bytes_max", "kv_cold_bytes_max"):
        if tier in a or tier in b:
            cell[tier] = max(a.get(tier, 0), b.get(tier, 0))
    if "peak_accelerator_bytes" in a or "peak_accelerator_bytes" in b:
        cell["peak_accelerator_bytes"] = max(a.get("peak_accelerator_bytes", 0), b.get("peak_accelerator_bytes", 0))
    if all("ttft_s" in x and "decode_tok_s" in x for x in rows):
        cell["ttft_s_median"] = sorted(x["ttft_s"] for x in rows)[done // 2]
        cell["decode_tok_s_median"] = sorted(x["decode_tok_s"] for x in rows)[done // 2]
    else:  # older rows carry no per-sample timings: the medians are the larger part's
        big = a if a["samples"] >= b["samples"] else b
        cell["ttft_s_median"], cell["decode_tok_s_median"] = big["ttft_s_median"], big["decode_tok_s_median"]
        cell["speed_medians_over_samples"] = big["samples"]
    return cell


def merge(parts: list[str], out, profiles: list[str] = (), first: int = 0) -> int:
    """Combine ladder parts run side by side or one after another (disjoint arms, --first-sample continuations).
    Cells starting at sample `first` (0, or a sample set of its own: --merge-first-sample) begin a cell; later ones
    continue one.

    An arm present in several parts keeps, per rung, the cell with the most samples (later parts win ties).
    Each cell records its device and `provenance`: per part it came from, the part's commit, dirty flag, device,
    machine, date and samples. Decode speed is compared with `full` on the same device only. The header describes
    the merge (its command, commit and date); the parts' own headers are listed under `parts`."""
    import json

    docs = [json.loads(pathlib.Path(p).read_text()) for p in parts]
    results, full_by_device, by_device = {}, {}, {}
    for p, d in zip(parts, docs):
        for arm, r in d["arms"].items():
            if r.get("status") == "ok":
                for n, c in list(r["rungs"].items()):
                    c.pop("from_part", None)
                    c.setdefault("device", cell_device(d))
                    c["provenance"] = [part_provenance(p, d) | (
                        {"samples": [first_sample(c), first_sample(c) + c["samples"] - 1]} if "samples" in c else {})]
                    if "restore_fidelity" in c:  # parts from before the field measured the same thing
                        c["restore_fidelity"].setdefault("scope", FIDELITY_SCOPE)
                    if first_sample(c) != first:  # a continuation: join it to the cell it continues
                        base = by_device.get((arm, n), {}).get(c["device"])
                        if base is None or first_sample(base) != first or first + base["samples"] != first_sample(c):
                            print(f"merge: {p}: {arm} @ {n} starts at sample {first_sample(c)} and continues no earlier "
                                  f"cell on {c['device']}: left out", file=sys.stderr)
                            del r["rungs"][n]
                            continue
                        c = r["rungs"][n] = join_cells(base, c)
                    if "rows" in c:
                        old = by_device.setdefault((arm, n), {}).get(c["device"])
                        if old is None or c["samples"] >= old["samples"]:
                            by_device[(arm, n)][c["device"]] = c
                    if arm == "full" and "recall" in c:
                        old = full_by_device.setdefault(c["device"], {}).get(n)
                        if old is None or c["samples"] >= old["samples"]:
                            full_by_device[c["device"]][n] = c
            have = results.get(arm)
            if have is None or have.get("status") != "ok" or r.get("status") != "ok":
                if have is None or r.get("status") == "ok":
                    results[arm] = r
                continue
            for n, c in r["rungs"].items():
                old = have["rungs"].get(n)
                if old is None or c.get("samples", -1) >= old.get("samples", -1):
                    have["rungs"][n] = c
    meta = run_metadata({"parts": parts, "profiles": list(profiles), "merge_first_sample": first, "eval_seed": EVAL_SEED,
                         "filler": EVAL_FILLER,
                         "needle": EVAL_NEEDLE, "question": EVAL_QUESTION})
    meta["parts"] = [part_provenance(p, d) | {"command": d.get("command"), "arms": list(d["arms"])} for p, d in zip(parts, docs)]
    # The same samples run on two devices (CPU and an accelerator): do the per-sample hits agree?
    agreement = {}
    for (arm, n), cells in by_device.items():
        devs = sorted(cells)
        for i, a in enumerate(devs):
            for b in devs[i + 1:]:
                ra, rb = cells[a]["rows"], cells[b]["rows"]
                common = min(len(ra), len(rb))
                agreement.setdefault(arm, {})[n] = {
                    "devices": [a, b], "common_samples": common,
                    "hits": [sum(x["hit"] for x in ra[:common]), sum(x["hit"] for x in rb[:common])],
                    "samples_whose_hit_differs": sum(x["hit"] != y["hit"] for x, y in zip(ra, rb)),
                    # parts may decode different answer lengths: compare the shorter answer with the other's start
                    "samples_whose_answer_differs": sum(not (x["answer"].startswith(y["answer"]) or y["answer"].startswith(x["answer"]))
                                                        for x, y in zip(ra, rb)),
                }
    meta["cross_device_agreement"] = agreement
    meta["targets"] = targets(results, vs_full(results, full_by_device))
    meta["notes"] = NOTES_DOC
    if profiles:
        split = {}
        for p in profiles:
            prof = json.loads(pathlib.Path(p).read_text())
            for n, arms in prof["results"].items():
                for arm, cell in arms.items():
                    split.setdefault(n, {})[arm] = {"decode_step_cpu_s": cell["decode_step_mean"],
                                                    "tokens_per_s_ratio_to_full": cell.get("tokens_per_s_ratio_to_full"),
                                                    "resident_kv_bytes": cell["resident_kv_bytes"], "from": p}
        meta["decode_step_time_split"] = split
    finish(pathlib.Path(out), meta, results, full_by_device)
    return 0


def plot(results, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    arms = [a for a, r in results.items() if r.get("status") == "ok"]
    colors = plt.get_cmap("tab20")
    for j, arm in enumerate(arms):
        r = results[arm]
        xs = sorted(int(n) for n, c in r["rungs"].items() if "recall" in c)
        style = dict(marker="o", color=colors(j % 20), linestyle="--" if "kakeya" in arm else "-", label=arm)
        axes[0].plot(xs, [r["rungs"][str(n)]["recall"] for n in xs], **style)
        axes[1].plot(xs, [r["rungs"][str(n)]["kv_live_bytes_max"] / 1e6 for n in xs], **style)
    axes[0].set(title="passkey recall (dashed: KakeyaLattice resident cache)", xlabel="prompt tokens", ylabel="recall",
                ylim=(-0.05, 1.05))
    axes[1].set(title="resident KV per session", xlabel="prompt tokens", ylabel="MB", yscale="log")
    for a in axes:
        a.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
