"""What `kakeya serve` is configured with, and the checks that need no model.

`ServeConfig` holds the product options; the options of research strategies sit apart in
`ServeConfig.research` (by option name, as the strategy's plugin declares them: kv/plugins.py;
reachable from research scripts and the `--research-*` serve flags, never part of the wire contract
or the SDK types). No torch, grpc or HTTP framework here: the app, the CLI and the HTTP shim all
import this module, and it imports none of them.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any


DEFAULT_WINDOW = 1020  # --window when not given: sink_window and dlm_restore
# strategies whose window defaults otherwise: paged's 508 keeps resident + selection under sink_window 4+1020's bytes up to
# 7.5k (issue 15), and is what its recall ladders, memory and decode figures measured (docs/paged.md)
STRATEGY_WINDOWS = {"paged": 508}
# paged's --page-far-from when not given, applied once a session passes the trained context (--page-far-after context):
# past it, what a session wrote from 4096 on is K/V of InfLLM's layout, which SmolLM2 reads well (its misses there sat in
# 4,096-8,192), and under it the session is the trained context's bit for bit (docs/paged.md, "far_from once past the
# context"); torch only (MLX: paged stops at the trained context)
PAGED_FAR_FROM = 4096
# paged's --page-choice-every on torch: a query past the trained context chooses its pages at every 4th position (the
# pre-registered ladder check, docs/paged.md "Choosing every N positions past the context")
PAGED_CHOICE_EVERY = 4


class ConfigError(ValueError):
    """A serve option the daemon cannot run with; the message names the option and the fix."""


@dataclass
class ServeConfig:
    bind: str = "127.0.0.1:50051"
    model: str = "smollm2-135m-instruct"
    kv_strategy: str = "sink_window"
    sink: int = 4
    # None: the strategy's own default (STRATEGY_WINDOWS): 508 for paged, the window every paged figure was measured
    # with (recall, memory, decode); 1020 for the others
    window: int | None = None
    kv_compressor: str = "identity"  # identity | kakeya_d4 | kakeya_e8 (resident cache store)
    # auto | fp32 | fp16 | int8: resident K/V rows of full / sink_window; auto = fp16 where the native CPU step reads
    # fp16 slabs with its AVX2 attention (measured faster there at every context, the same agreement), else fp32
    kv_dtype: str = "auto"
    batching: str = "auto"  # auto | on | off: concurrent sessions' steps share forwards (auto = where exact: int8/int4)
    kv_q_range: int = 38  # lattice q_range of the kakeya compressors
    page_size: int = 64  # paged: tokens per page of evicted K/V
    recall_pages: int = 8  # paged: pages each query attends to besides sink and window
    page_compressor: str = "identity"  # paged: stored pages as identity | int8 | kakeya_d4 | kakeya_e8
    page_shortlist: int = 64  # paged: past page_shortlist_from candidate pages, rank pages by key bounds, score the best N
    page_shortlist_from: int = 256  # paged: candidate pages past which the shortlist applies (page_shortlist 0: never)
    page_ram_mb: int = 128  # paged: MB of a session's page store kept in host RAM; the rest in a spill file (0 = all in RAM)
    # paged: positions from which queries attend in InfLLM's layout (0 = the trained context); None = paged's default,
    # PAGED_FAR_FROM once past the context on torch (`resolved_far_from`)
    page_far_from: int | None = None
    page_far_layout: str = "packed"  # paged, from page_far_from on: packed (next to the window) | spread (gaps scaled)
    # paged with page_far_from: from a session's start | once it passes the trained context; None = "context" for paged's
    # default far_from, "start" for one given (`resolved_far_after`)
    page_far_after: str | None = None
    # paged, from the trained context on: a query chooses its pages at every N-th position, the others attend to the
    # last choice's pages (1 = every query chooses); None = paged's default, PAGED_CHOICE_EVERY on torch
    # (`resolved_choice_every`)
    page_choice_every: int | None = None
    page_spill_dir: str | None = None  # paged: where spill files go; None = <state dir>/spill with --persist turn, else temp
    # glibc: allocations of at least this many KiB get maps of their own, returned to the OS when freed (0 = glibc's
    # dynamic threshold, under which freed MB-sized tensors stay with the heap): server/host_memory.py
    malloc_mmap_threshold_kb: int = 0
    malloc_trim: bool = True  # glibc: the heap's freed memory back to the OS each time the engine loop goes idle
    capacity: int = 16
    idle_ttl: float = 1800.0
    metrics_port: int = 0  # 0 = off
    http_port: int = 0  # 0 = off (deprecated OpenAI-style shim)
    api_key: str | None = None
    device: str = "cpu"
    compile: str = "auto"  # off | auto | on: the step as captured CUDA graphs, inductor-fused where triton is (auto: CUDA only)
    backend: str = "torch"  # torch | mlx (backends/mlx; needs the mlx extra)
    threads: int | str | None = None  # None = torch's choice, "auto" = fastest measured (engine/tuning.py)
    # auto: the weights read with safetensors where backends/torch/checkpoint.py reads the config completely (Llama,
    # Mistral, Qwen2/3 with the default RoPE: ~5 s less of a start, transformers' imports), else through transformers
    loader: str = "auto"  # auto | transformers (the torch backend's; MLX loads its own way)
    weights: str = "auto"  # fp32 | int8 | int4 | auto (int4 on cpu, fp32 elsewhere: scripts/bench_weights.py)
    # the CPU int4 kernel's activations: int16 (two int8 planes, >= 99 % top-1 agreement with fp32) | int8 (one plane
    # with 16 outlier channels exact, as llama.cpp's Q8 activations: 98.83 %, each extra row ~22 % cheaper)
    activations: str = "int16"
    prefill_chunk: int = 256
    prefill_chunk_shared: int = 8  # a forward's tokens while other sessions generate: rows, then prefill (batching on; 0 = whole chunks)
    max_workers: int = 16
    drafter: str | None = None  # "ngram" (prompt lookup), a shipped drafter name or checkpoint dir; enables speculation
    # drafts per verify step: 3, measured faster than 4 for ngram on every style on the CPU (a 4-row verify block
    # stays on torch's cheap int4 path, a 5-row one costs 2.69x a decode row: results/speculative_ngram_k3.json,
    # results/research/linear_rows.json)
    spec_k: int = 3
    state_dir: str | None = None  # persisted sessions; None = $KAKEYA_STATE_DIR, else $KAKEYA_HOME/state
    persist: str = "turn"  # turn: save each session after every turn (spill, resume) | off: memory only
    # Several daemons on one state directory (behind a proxy, deploy/): each session is held through a lease
    # renewed by its daemon's heartbeat; a silent daemon's sessions are taken over after lease_ttl seconds.
    shared_state_dir: bool = False
    lease_ttl: float = 10.0
    # One client's paste must not queue minutes of prefill in a daemon others use interactively: at most
    # this many tokens per AppendTokens / CreateSession (2x SmolLM2's 8k context), and per session appended
    # but not yet prefilled (0 = no limit). At ~450 prefill tok/s on 2 cores, 32k pending is ~70 s of work.
    max_append_tokens: int = 16384
    max_pending_tokens: int = 32768
    # Options of research strategies (StrategyPlugin.options), by name; unset = the option's default. Not product surface.
    research: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Every rule about these options that needs no model and no side effect, in one place (ConfigError
        naming the option and the fix); `kakeya serve` applies it before loading anything. What needs the
        loaded model (its backend, weight format and kernels) is checked by app.build_engine; the ports and
        the state directory by app.check_before_loading. The engine's and the strategy's own rules are the
        ones the library applies (engine/requests.check_engine_options, the strategy's parameters), run here."""
        from inference_engine.engine.requests import check_engine_options

        split_bind(self.bind)
        choices = {"--backend": (self.backend, ("torch", "mlx")), "--persist": (self.persist, ("off", "turn")),
                   "--compile": (self.compile, ("off", "auto", "on")), "--loader": (self.loader, ("auto", "transformers")),
                   "--weights": (self.weights, ("auto", "fp32", "fp16", "int8", "int4")),
                   "--activations": (self.activations, ("int16", "int8"))}
        for flag, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConfigError(f"{flag} must be {' or '.join(map(repr, allowed))}, got {value!r}")
        check_backend_flags(self, self.backend)
        if self.kv_dtype not in ("fp32", "auto") and self.device != "cpu":
            raise ConfigError(f"--kv-dtype {self.kv_dtype} is a CPU K/V store; on --device {self.device} leave --kv-dtype "
                              "at fp32 (the model's dtype)")
        for flag, n in (("--max-append-tokens", self.max_append_tokens), ("--max-pending-tokens", self.max_pending_tokens)):
            if n < 0:
                raise ConfigError(f"{flag} takes a token count >= 0 (0 = no limit), got {n}")
        if isinstance(self.malloc_mmap_threshold_kb, bool) or not isinstance(self.malloc_mmap_threshold_kb, int) \
                or self.malloc_mmap_threshold_kb < 0:
            raise ConfigError(f"--malloc-mmap-threshold-kb takes a number of KiB >= 0 (0 = glibc's dynamic threshold), "
                              f"got {self.malloc_mmap_threshold_kb!r}")
        if isinstance(self.page_ram_mb, bool) or not isinstance(self.page_ram_mb, int) or self.page_ram_mb < 0:
            raise ConfigError(f"--page-ram-mb takes a number of MB >= 0 (0 = keep every page in RAM), got {self.page_ram_mb!r}")
        if self.capacity < 1:
            raise ConfigError(f"--capacity takes a number of sessions >= 1, got {self.capacity}")
        if not self.idle_ttl >= 0:
            raise ConfigError(f"--idle-ttl takes a number of seconds >= 0 (0 = never), got {self.idle_ttl}")
        if self.threads not in (None, "auto") and not (isinstance(self.threads, int) and self.threads >= 1):
            raise ConfigError(f"--threads takes a count >= 1 or auto, got {self.threads!r}")
        if self.shared_state_dir and self.persist != "turn":
            raise ConfigError("--shared-state-dir shares sessions through the state directory: it needs --persist turn")
        if not self.lease_ttl > 0:
            raise ConfigError(f"--lease-ttl takes a number of seconds > 0, got {self.lease_ttl}")
        try:
            check_engine_options(prefill_chunk=self.prefill_chunk, spec_k=self.spec_k if self.drafter else 0,
                                 batching=self.batching, prefill_chunk_shared=self.prefill_chunk_shared,
                                 has_drafter=bool(self.drafter))
            self.strategy()
        except ValueError as e:
            raise ConfigError(str(e)) from e

    @property
    def resolved_far_from(self) -> int:
        """--page-far-from as given, else paged's default on the torch backend (PAGED_FAR_FROM, where the layout's reach,
        sink + window + recall pages x page size, fits under it), else 0."""
        if self.page_far_from is not None:
            return self.page_far_from
        reach = self.sink + self.resolved_window + self.recall_pages * self.page_size  # the layout must fit under it
        return PAGED_FAR_FROM if self.kv_strategy == "paged" and self.backend == "torch" and reach <= PAGED_FAR_FROM else 0

    @property
    def resolved_far_after(self) -> str:
        """--page-far-after as given, else "context" where paged's default far_from applies, else "start" (a far_from
        given alone keeps its meaning from before the default: from a session's start)."""
        if self.page_far_after is not None:
            return self.page_far_after
        return "context" if self.page_far_from is None and self.resolved_far_from else "start"

    @property
    def resolved_choice_every(self) -> int:
        """--page-choice-every as given, else paged's default on the torch backend (PAGED_CHOICE_EVERY: past the trained
        context, where the MLX backend's paged stops), else 1."""
        if self.page_choice_every is not None:
            return self.page_choice_every
        return PAGED_CHOICE_EVERY if self.kv_strategy == "paged" and self.backend == "torch" else 1

    @property
    def resolved_window(self) -> int:
        """--window as given, else the strategy's default window."""
        return self.window if self.window is not None else STRATEGY_WINDOWS.get(self.kv_strategy, DEFAULT_WINDOW)

    def strategy(self, kv_dtype: str | None = None):
        """The KV strategy these options name (its parameters checked: ValueError naming the one at fault), and
        its plugin's options (kv/plugins.py: defaults overridden by `research`), which its resources are built from.
        kv_dtype: what --kv-dtype auto resolved to for the loaded model (app.resolve_kv_dtype); without it auto
        stands for fp32 (every strategy takes that)."""
        import dataclasses

        from inference_engine.kv import registry

        options = registry.options_for(self.kv_strategy, self.research)
        fields = {f.name for f in dataclasses.fields(registry.plugin(self.kv_strategy).params)}
        # a research option named after a field of the strategy's parameters sets it; the others go to its resources
        strategy = registry.make_strategy(self.kv_strategy, self.sink, self.resolved_window, compressor=self.kv_compressor,
                                          kv_dtype=kv_dtype or (self.kv_dtype if self.kv_dtype != "auto" else "fp32"),
                                          q_range=self.kv_q_range, page_size=self.page_size,
                                          recall_pages=self.recall_pages, page_compressor=self.page_compressor,
                                          shortlist_pages=self.page_shortlist, shortlist_from=self.page_shortlist_from,
                                          page_ram_mb=self.page_ram_mb, far_from=self.resolved_far_from,
                                          far_layout=self.page_far_layout, far_after=self.resolved_far_after,
                                          choice_every=self.resolved_choice_every,
                                          **{k: v for k, v in options.items() if k in fields})
        return strategy, options


def split_bind(bind: str) -> tuple[str, int]:
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--bind must be HOST:PORT, got {bind!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


MLX_STRATEGIES = ("full", "sink_window", "paged")  # the strategies the MLX backend runs


def check_backend_flags(cfg: ServeConfig, backend: str) -> None:
    """The options `backend` cannot run (no model needed: ServeConfig.validate checks them before loading one)."""
    if backend != "mlx":
        return
    if cfg.kv_strategy not in MLX_STRATEGIES:
        raise ConfigError(f"--kv-strategy {cfg.kv_strategy} runs on --backend torch only; with --backend mlx use "
                          f"{' or '.join(MLX_STRATEGIES)}")
    if cfg.kv_compressor != "identity":
        raise ConfigError(f"--kv-compressor {cfg.kv_compressor} runs on --backend torch only; with --backend mlx use identity")
    if cfg.kv_strategy == "paged" and cfg.page_compressor != "identity":
        raise ConfigError(f"--page-compressor {cfg.page_compressor} runs on --backend torch only; with --backend mlx use identity")
    if cfg.kv_dtype not in ("fp32", "auto"):
        raise ConfigError(f"--kv-dtype {cfg.kv_dtype} runs on --backend torch only; with --backend mlx use fp32")
    if cfg.kv_strategy == "paged" and cfg.page_far_layout != "packed":
        raise ConfigError(f"--page-far-layout {cfg.page_far_layout} runs on --backend torch only (it moves recalled keys "
                          "with its rotate_keys); with --backend mlx use packed (paged stops at the trained context there)")
    if cfg.kv_strategy == "paged" and cfg.page_choice_every not in (None, 1):
        raise ConfigError(f"--page-choice-every {cfg.page_choice_every} runs on --backend torch only (it applies past the "
                          "trained context, where paged stops on --backend mlx); with --backend mlx use 1")
    if cfg.kv_strategy == "paged" and cfg.page_far_from:
        raise ConfigError(f"--page-far-from {cfg.page_far_from} runs on --backend torch only (InfLLM's layout moves recalled "
                          "keys with its rotate_keys); with --backend mlx use 0 (paged stops at the trained context there)")
    if cfg.drafter and cfg.drafter != "ngram" and cfg.spec_k:
        raise ConfigError(f"--drafter {cfg.drafter} (a dLM drafter) runs on --backend torch only; with --backend mlx use "
                          "--drafter ngram")
    if cfg.activations != "int16":
        raise ConfigError(f"--activations {cfg.activations} sets the torch backend's CPU int4 kernel; with --backend mlx "
                          "leave it at int16")
    if cfg.loader != "auto":
        raise ConfigError(f"--loader {cfg.loader} sets how the torch backend reads the weights; with --backend mlx leave "
                          "it at auto")


def check_exposure(cfg: ServeConfig) -> None:
    host, _ = split_bind(cfg.bind)
    if not is_loopback(host) and not cfg.api_key:
        raise ConfigError(
            f"refusing to bind {cfg.bind} (not loopback) without an API key; pass --api-key or set KAKEYA_API_KEY"
        )
