"""`kakeya` command line: serve the daemon, manage models and saved sessions; `kakeya chat` runs the SDK's chat."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from inference_engine.server import chat_command
from inference_engine.server.app import serve_forever
from inference_engine.kv import registry
from inference_engine.kv.strategy import FAR_AFTER, FAR_LAYOUTS
from inference_engine.server.config import PAGED_FAR_FROM, DEFAULT_WINDOW, STRATEGY_WINDOWS, ConfigError, ServeConfig


def _add_serve(sub) -> None:
    d = ServeConfig()
    p = sub.add_parser("serve", help="run the gRPC daemon", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--bind", default=d.bind, help="HOST:PORT for gRPC (port 0 = pick a free one)")
    p.add_argument("--model", default=d.model, help="pulled model name or a local HF model directory")
    strategies = registry.plugins()
    p.add_argument("--kv-strategy", default=d.kv_strategy, choices=tuple(strategies),
                   help="; ".join(f"{name}: {s.help}" for name, s in strategies.items()))
    p.add_argument("--sink", type=int, default=d.sink, help="attention-sink positions (every strategy but full)")
    p.add_argument("--window", type=int, default=d.window,
                   help="sliding-window positions (every strategy but full; unset: the strategy's own, "
                        + ", ".join(f"{w} for {name}" for name, w in STRATEGY_WINDOWS.items())
                        + f", {DEFAULT_WINDOW} for the others)")
    p.add_argument("--kv-compressor", default=d.kv_compressor, choices=("identity", "kakeya_d4", "kakeya_e8"),
                   help="resident KV store: identity (uncompressed) or KakeyaLattice D4/E8 codes (needs kakeyalattice)")
    p.add_argument("--kv-dtype", default=d.kv_dtype, choices=("auto", "fp32", "fp16", "int8"),
                   help="resident K/V rows of full / sink_window / paged: fp32; fp16 (CPU: half the bytes, attention in "
                        "fp32 on the stored values; paged: its page store in fp16 too); int8 (full / sink_window) with a "
                        "scale per position, read by attention without decoding; auto (default) = fp16 for full / "
                        "sink_window where the native CPU step's AVX2 attention reads it, else fp32")
    p.add_argument("--batching", default=d.batching, choices=("auto", "on", "off"),
                   help="continuous batching: concurrent sessions' decode/verify/prefill steps share forwards; auto = on where "
                        "each session's output stays bit-identical to running alone (int8/int4 weights), off otherwise")
    p.add_argument("--kv-q-range", type=int, default=d.kv_q_range, help="KakeyaLattice q_range (higher = finer, more bytes)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="paged: tokens per page of evicted K/V")
    p.add_argument("--recall-pages", type=int, default=d.recall_pages,
                   help="paged: pages each query attends to (per layer and KV head) besides sink and window")
    p.add_argument("--page-compressor", default=d.page_compressor, choices=("identity", "int8", "kakeya_d4", "kakeya_e8"),
                   help="paged: how evicted pages are stored (decoded only when recalled)")
    p.add_argument("--page-shortlist", type=int, default=d.page_shortlist,
                   help="paged: past --page-shortlist-from candidate pages, rank pages by per-page key bounds and score the "
                        "keys of the best N only (at least --recall-pages; the bounds are ~1/8 of the keys' bytes); 0 = score "
                        "every evicted key each step")
    p.add_argument("--page-shortlist-from", type=int, default=d.page_shortlist_from,
                   help="paged: candidate pages past which the shortlist applies (256 = 16k tokens with pages of 64: where it "
                        "measured faster than scoring every key on the development CPU)")
    p.add_argument("--page-ram-mb", type=int, default=d.page_ram_mb, metavar="MB",
                   help="paged: host RAM per session for the page store (the exact K/V of evicted positions); pages past "
                        "it are kept in a memory-mapped spill file on disk and read from there when recalled; 0 = keep "
                        "every page in RAM")
    p.add_argument("--page-far-from", type=int, default=d.page_far_from, metavar="POS",
                   help="paged: positions from which a query attends in InfLLM's layout (its recalled pages and the sink "
                        "moved next to its window); 0 = the model's trained context. Below it queries attend at true "
                        f"positions. Not given: {PAGED_FAR_FROM} once a session passes the trained context (see "
                        "--page-far-after; torch only); given alone: from a session's start (docs/paged.md, 'Where the "
                        "InfLLM layout starts', 'far_from once past the context')")
    p.add_argument("--page-far-layout", choices=FAR_LAYOUTS, default=d.page_far_layout,
                   help="paged, from --page-far-from on: where a query's recalled pages and the sink sit. packed: next to "
                        "its window in position order (InfLLM's); spread: in position order with the gaps between them "
                        "scaled down so the history seen spans --page-far-from positions (docs/paged.md, 'The spread layout')")
    p.add_argument("--page-far-after", choices=FAR_AFTER, default=d.page_far_after,
                   help="paged, with --page-far-from: start = that layout from a session's first position; context = a "
                        "session runs as --page-far-from 0 until it would pass the trained context, and from then on as "
                        "one that ran --page-far-from from its start (re-encoded once from its tokens if it already holds "
                        "positions past --page-far-from; docs/paged.md, 'far_from once past the context'). Not given: "
                        "context with the default --page-far-from, start with one given")
    p.add_argument("--page-choice-every", type=int, default=d.page_choice_every, metavar="N",
                   help="paged, from the trained context on: a query chooses its pages itself at every N-th position, "
                        "the others attend to the pages the last of those chose (each with its own window): about N "
                        "times less page-choice work per token past the context; 1 = every query chooses. Not given: 4 on the "
                        "torch backend (1 on MLX, where paged stops at the context). "
                        "Below the trained context every query chooses. A function of the position: chunks, verify "
                        "blocks and one-token steps agree bit for bit (docs/paged.md, 'Choosing every N positions')")
    p.add_argument("--page-spill-dir", default=None, metavar="DIR",
                   help="paged: where the page store's spill files are created (unlinked at once: nothing is left behind) "
                        "(default: <state dir>/spill with --persist turn, else the system temp dir)")
    p.add_argument("--malloc-mmap-threshold-kb", type=int, default=d.malloc_mmap_threshold_kb, metavar="KIB",
                   help="glibc: allocations of at least this many KiB get maps of their own, returned to the OS when "
                        "freed (prefill chunks' and archived pages' tensors); 0 = glibc's dynamic threshold, under which "
                        "freed MB-sized tensors stay with the process's heap; MALLOC_MMAP_THRESHOLD_ in the environment wins. Default 0: a "
                        "fixed one lowers a session's peak a little and costs prefill more (docs/paged.md)")
    p.add_argument("--malloc-trim", choices=("on", "off"), default="on" if d.malloc_trim else "off",
                   help="glibc: hand the heap's freed memory back to the OS (malloc_trim) each time the engine loop "
                        "runs out of work, so what the daemon holds between turns is what its sessions hold (3-7 ms "
                        "a call, off the turns' path)")
    p.add_argument("--capacity", type=int, default=d.capacity,
                   help="max live sessions; beyond it the least recently used idle session is spilled to disk (--persist turn) "
                        "or, with --persist off, CreateSession is refused with RESOURCE_EXHAUSTED")
    p.add_argument("--idle-ttl", type=float, default=d.idle_ttl,
                   help="seconds before an idle session leaves memory: spilled to disk with --persist turn (it resumes on its "
                        "next call), dropped with --persist off (0 = never)")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port (0 = off)")
    p.add_argument("--http-port", type=int, default=d.http_port, help="deprecated OpenAI-style HTTP shim port (0 = off)")
    p.add_argument("--api-key", default=os.environ.get("KAKEYA_API_KEY"), help="require 'authorization: Bearer KEY' (env KAKEYA_API_KEY)")
    p.add_argument("--device", default=d.device, help="torch device: cpu or cuda")
    p.add_argument("--compile", default=d.compile, choices=("off", "auto", "on"),
                   help="CUDA: decode rows and verify blocks as captured graphs of the whole step, the rest as graphs of "
                        "the dense work; auto = with inductor's fused kernels where triton is present (measured faster: "
                        "scripts/gpu_check.py), eager pieces if a compile fails; on = inductor always; off = eager. "
                        "CPU: auto = off (inductor measured no faster there)")
    p.add_argument("--loader", default=d.loader, choices=("auto", "transformers"),
                   help="torch backend: how the weights are read. auto = with safetensors where the config is one it reads "
                        "completely (Llama, Mistral, Qwen2/3 with the default RoPE; a start ~5 s sooner without "
                        "transformers' imports), through transformers otherwise; transformers = always through "
                        "transformers' AutoModelForCausalLM (the same weights either way: tests/backends/test_checkpoint.py)")
    p.add_argument("--backend", default=d.backend, choices=("torch", "mlx"),
                   help="model backend: torch, or mlx (Apple's framework: Metal on Apple Silicon, CPU elsewhere; needs "
                        "pip install 'kakeya-runtime[mlx]'; strategies full, sink_window and paged (identity pages); see docs/mlx.md)")
    p.add_argument("--threads", type=_threads, default=None,
                   help="torch intra-op threads: N, or auto = the count that decodes fastest here, measured at startup "
                        "(default: torch's choice)")
    p.add_argument("--activations", default=d.activations, choices=("int16", "int8"),
                   help="the CPU int4 kernel's activations (native step): int16 = two int8 planes, ~16 bits (99.34 %% "
                        "top-1 agreement with fp32 on SmolLM2: passes the 99 %% gate); int8 = one plane with 16 outlier "
                        "channels added exactly, as llama.cpp's Q8 activations (98.83 %%, llama.cpp 97.70 %%), each extra "
                        "row of a verify block or batch ~22 %% cheaper")
    p.add_argument("--weights", default=d.weights, choices=("auto", "fp32", "fp16", "int8", "int4"),
                   help="weight format of the torch backend: int4 = the GGUF's own Q4_1 blocks (fastest; passes the "
                        "quality gate), int8 = per-row int8 (misses the gate), auto = int4 on cpu, fp32 on other devices; "
                        "--backend mlx: fp32, fp16 or int4 (the same Q4_1 blocks), auto = int4")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, help="tokens per prefill forward (bounds peak memory)")
    p.add_argument("--prefill-chunk-shared", type=int, default=d.prefill_chunk_shared,
                   help="with batching on, tokens per forward while other sessions are generating: their decode rows "
                        "first, a prefill chunk the rest (at least half), so their next tokens wait one such forward, "
                        "not a whole --prefill-chunk (0 = whole --prefill-chunk chunks)")
    p.add_argument("--drafter", default=None,
                   help="speculative decoding: ngram (draft-free prompt lookup in the session's history) or a dLM drafter "
                        "(shipped name, e.g. smollm2-135m-dlm, or a checkpoint dir)")
    p.add_argument("--spec-k", type=int, default=d.spec_k,
                   help="tokens drafted per speculative step (with --drafter); 0 = no speculative decoding (e.g. a drafter used "
                        "only by a research strategy)")
    p.add_argument("--state-dir", default=None,
                   help="where sessions are persisted (default: $KAKEYA_STATE_DIR, else $KAKEYA_HOME/state); see docs/persistence.md")
    p.add_argument("--persist", default=d.persist, choices=("off", "turn"),
                   help="turn: save each session after every turn, spill evicted sessions to disk and resume them after a "
                        "restart or crash; off: sessions live in memory only")
    p.add_argument("--shared-state-dir", action="store_true",
                   help="several daemons share --state-dir (replicas behind a proxy, see deploy/): each session is held "
                        "by one daemon through a lease in the directory, renewed by that daemon's heartbeat; a call for a "
                        "session another live daemon holds answers UNAVAILABLE (the SDKs retry), and a daemon's sessions "
                        "are taken over once it has been silent for --lease-ttl")
    p.add_argument("--lease-ttl", type=_seconds, default=d.lease_ttl, metavar="S",
                   help="--shared-state-dir: seconds without a heartbeat after which a daemon's sessions may be taken over")
    p.add_argument("--max-append-tokens", type=_limit, default=d.max_append_tokens, metavar="N",
                   help="most tokens one AppendTokens (or CreateSession) may carry; more answers INVALID_ARGUMENT (0 = no limit)")
    p.add_argument("--max-pending-tokens", type=_limit, default=d.max_pending_tokens, metavar="N",
                   help="most tokens a session may hold appended but not yet prefilled (Generate prefills them); an append "
                        "past it answers RESOURCE_EXHAUSTED (0 = no limit)")
    _add_research(p)
    p.set_defaults(func=_run_serve)


def _add_research(p) -> None:
    """The options of research strategies (kv/plugins.py): reachable for experiments, not part of the product surface."""
    options = registry.research_options()
    if not options:
        return
    owners = sorted({owner.name for owner, _ in options.values()})
    g = p.add_argument_group("research (not product surface)",
                             f"options of the research strategies ({', '.join(owners)}); they may change or go away between releases")
    for owner, o in options.values():
        g.add_argument(o.flag, dest=f"research_{o.name}", default=o.default, type=o.type, choices=o.choices, metavar=o.metavar,
                       help=f"{owner.name}: {o.help}")


def _research(args) -> dict:
    """The research options set away from their defaults (ServeConfig.research)."""
    out = {}
    for _, o in registry.research_options().values():
        value = getattr(args, f"research_{o.name}", o.default)
        if value != o.default:
            out[o.name] = value
    return out


def _threads(value: str):
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes a positive int or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--threads takes a positive int or 'auto', got {n}")
    return n


def _seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of seconds > 0, got {value!r}") from None
    if not s > 0 or s == float("inf"):
        raise argparse.ArgumentTypeError(f"takes a number of seconds > 0, got {value!r}")
    return s


def _limit(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a token count >= 0 (0 = no limit), got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"takes a token count >= 0 (0 = no limit), got {n}")
    return n


def serve_config(args) -> ServeConfig:
    """The ServeConfig that `kakeya serve` arguments describe."""
    return ServeConfig(
        bind=args.bind,
        model=args.model,
        kv_strategy=args.kv_strategy,
        sink=args.sink,
        window=args.window,
        kv_compressor=args.kv_compressor,
        kv_dtype=args.kv_dtype,
        batching=args.batching,
        kv_q_range=args.kv_q_range,
        page_size=args.page_size,
        recall_pages=args.recall_pages,
        page_compressor=args.page_compressor,
        page_shortlist=args.page_shortlist,
        page_shortlist_from=args.page_shortlist_from,
        page_ram_mb=args.page_ram_mb,
        page_far_from=args.page_far_from,
        page_far_layout=args.page_far_layout,
        page_far_after=args.page_far_after,
        page_choice_every=args.page_choice_every,
        page_spill_dir=args.page_spill_dir,
        malloc_mmap_threshold_kb=args.malloc_mmap_threshold_kb,
        malloc_trim=args.malloc_trim == "on",
        capacity=args.capacity,
        idle_ttl=args.idle_ttl,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        api_key=args.api_key or None,
        device=args.device,
        compile=args.compile,
        loader=args.loader,
        backend=args.backend,
        threads=args.threads,
        weights=args.weights,
        activations=args.activations,
        prefill_chunk=args.prefill_chunk,
        prefill_chunk_shared=args.prefill_chunk_shared,
        drafter=args.drafter,
        spec_k=args.spec_k,
        state_dir=args.state_dir,
        persist=args.persist,
        shared_state_dir=args.shared_state_dir,
        lease_ttl=args.lease_ttl,
        max_append_tokens=args.max_append_tokens,
        max_pending_tokens=args.max_pending_tokens,
        research=_research(args),
    )


def _run_serve(args) -> int:
    return serve_forever(serve_config(args))


def build_parser() -> argparse.ArgumentParser:
    from inference_engine.model_store import cli as models_cli
    from inference_engine.persistence import cli as sessions_cli
    from inference_engine.server import cluster

    ap = argparse.ArgumentParser(prog="kakeya", description="Kakeya session runtime")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    models_cli.register(sub)
    sessions_cli.register(sub)
    cluster.register(sub)
    chat_command.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if args.command == "chat":  # the SDK's kakeya-chat parses its own arguments
        return chat_command.run(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError, ImportError) as e:  # ImportError: kakeyalattice missing
        print(f"kakeya: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
