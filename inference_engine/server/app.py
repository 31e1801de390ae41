"""Assemble and run the daemon: model -> engine -> runtime -> gRPC (+ metrics, + HTTP shim)."""
from __future__ import annotations

import faulthandler
import logging
import signal
import threading
from concurrent import futures

from inference_engine.server.config import ConfigError, ServeConfig, check_backend_flags, check_exposure, split_bind
from inference_engine.server.runtime import Runtime

# Config names stay importable from here (scripts and tests build servers through this module).
__all__ = ["ConfigError", "RunningServer", "ServeConfig", "build_engine", "build_runtime", "check_exposure",
           "load_model", "serve_forever", "spill_dir", "split_bind", "start", "use_spill_dir"]

log = logging.getLogger("kakeya")


def model_thread():
    """The process's one ModelThread (engine/model_thread.py): it loads models and runs every
    forward of every runtime built here, so torch keeps a single multi-threaded OpenMP pool."""
    global _MODEL_THREAD
    with _MODEL_THREAD_LOCK:
        if _MODEL_THREAD is None:
            from inference_engine.engine.model_thread import ModelThread

            _MODEL_THREAD = ModelThread()
        return _MODEL_THREAD


_MODEL_THREAD = None
_MODEL_THREAD_LOCK = threading.Lock()


def load_model(cfg: ServeConfig):
    """Load the model `cfg` names, on the model thread."""
    return model_thread().call(lambda: _load_model(cfg))


def _load_model(cfg: ServeConfig):
    from inference_engine.model_store import resolve_model

    if cfg.backend == "mlx":
        return load_mlx_model(cfg, resolve_model(cfg.model))
    if cfg.backend != "torch":
        raise ConfigError(f"--backend must be torch or mlx, got {cfg.backend!r}")
    from inference_engine.backends.torch.model import TorchCausalLM

    weights = cfg.weights if cfg.weights != "auto" else ("int4" if cfg.device == "cpu" else "fp32")
    try:
        model = TorchCausalLM.load(resolve_model(cfg.model), device=cfg.device, weights=weights, loader=cfg.loader)
        from inference_engine.backends.torch import native

        model.use_step_graphs(cfg.compile, planes=native.ACTIVATIONS[cfg.activations])
        if cfg.activations != "int16" and (model.native_step is None or not model.native_step.q4):
            raise ConfigError(f"--activations {cfg.activations} sets the native CPU step's int4 kernel (--weights int4 "
                              f"on a CPU with AVX2, --compile auto), which this daemon does not run (its step: "
                              f"{', '.join(f'{k} {v}' for k, v in model.describe_step().items())})"
                              "; leave --activations at int16")
        model.defer_fallback()  # the native step's own int4 copies serve every step: torch's are read back if ever needed
        if model.graphs is not None:
            t = model.graphs.prepare((1,))  # the batch-1 decode step now; other row counts on first use
            log.info("--compile %s: the step's dense work runs as CUDA graphs (buckets of %s rows, captured on first "
                     "use; batch 1 captured at start in %.2f s)", cfg.compile, "/".join(map(str, model.graphs.buckets)), t)
            # decode rows and verify blocks as whole-step graphs, attention included, over a K/V arena with a
            # slot for every session the daemon holds in memory (--capacity) and two for transient caches;
            # their dense work and attention as inductor's fused kernels with --compile on, and with auto where
            # triton is present: on an H200 that decoded 448.6 tok/s against 283.3 with eager pieces, the same
            # tokens as transformers on 4 of 4 prompts (results/gpu_check.json); auto falls back to eager pieces
            # if a compile fails
            if model.device.type == "cuda":
                from inference_engine.backends.torch.graphs import inductor_available

                compiled = cfg.compile == "on" or (cfg.compile == "auto" and inductor_available())
                model.use_row_graphs(cfg.capacity + 2, compiled=compiled, fallback=cfg.compile == "auto")
        return model
    except ValueError as e:
        raise ConfigError(str(e)) from e


def load_mlx_model(cfg: ServeConfig, path):
    """--backend mlx: MLX picks its own device (Metal on Apple Silicon, CPU elsewhere); auto weights = int4."""
    from inference_engine.backends.mlx import MlxUnavailable, require_mlx

    try:
        require_mlx()
    except MlxUnavailable as e:
        raise ConfigError(str(e)) from e
    from inference_engine.backends.mlx.model import MlxCausalLM

    try:
        return MlxCausalLM.load(path, weights="int4" if cfg.weights == "auto" else cfg.weights)
    except ValueError as e:
        raise ConfigError(str(e)) from e


# What the MLX backend runs today (docs/mlx.md); the rest needs --backend torch.
def check_backend_options(cfg: ServeConfig, model) -> None:
    check_backend_flags(cfg, getattr(model, "backend_name", "torch"))


def resolve_kv_dtype(cfg: ServeConfig, model) -> str:
    """--kv-dtype as the engine takes it: auto = fp16 where the native CPU row step's attention reads fp16 slabs
    converting them in its registers (`fp16_in_registers`: its AVX2 code, and the 16-lane code of AVX-512 builds):
    `full` / `sink_window` without a compressor (the same top-1 agreement with fp32 as fp32 K/V, a decode step
    1.03x / 1.10x / 1.16x faster at 128 / 1k / 4k tokens and half the K/V bytes on the AVX2 EPYC it was measured on:
    results/research/kv_fp16_avx2.json; 1.04x / 1.09x / 1.25x on an AVX-512 EPYC, 99.53 % agreement against fp32
    K/V's 99.49 %: results/research/kv_fp16_avx512_in_registers.json, kv_fp16_avx512.json) and `paged` with exact
    pages (--page-compressor identity: the slab and the page store in fp16, half the page RAM and spill bytes, decode
    1.09-1.11x faster at 1k-32k on the AVX2 EPYC; the needle ladder at 7.5k, N = 40: 33 vs 34 of 40, 39 answers
    identical, and several keys at 4k the same answers: results/research/parts/paged_kv_fp16_avx2/read_run.json,
    niah_paged_kv_fp16_*.json; docs/paged.md); fp32 everywhere else: CUDA, MLX, the Python pieces, and a build whose
    attention would convert a copy of each chunk first (0.83x at 4k on the AVX-512 EPYC: kv_fp16_avx512.json)."""
    if cfg.kv_dtype != "auto":
        return cfg.kv_dtype
    step = getattr(model, "native_step", None)
    exact = cfg.kv_compressor == "identity" and (cfg.kv_strategy in ("full", "sink_window")
                                                 or (cfg.kv_strategy == "paged" and cfg.page_compressor == "identity"))
    if getattr(model, "backend_name", "torch") != "torch" or step is None or not exact:
        return "fp32"
    return "fp16" if step.module.fp16_in_registers() else "fp32"


def build_engine(cfg: ServeConfig, model, model_thread=None):
    """Engine for `cfg` around an already loaded model (benchmarks share one model across arms).
    model_thread: the ModelThread that runs its loop (None: the callers' threads)."""
    from inference_engine.engine.generate import Engine
    from inference_engine.kv import registry

    check_backend_options(cfg, model)
    try:
        plugin = registry.plugin(cfg.kv_strategy)
        kv_dtype = resolve_kv_dtype(cfg, model)
        if cfg.kv_dtype == "auto":
            log.info("--kv-dtype auto: resident K/V in %s", kv_dtype)
        strategy, options = cfg.strategy(kv_dtype=kv_dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    drafter = None
    quantized = model.weights_format not in ("fp32", "bf16", "fp16")
    if cfg.drafter and cfg.spec_k and quantized and not plugin.exact_verify:
        # Verify steps are row-exact (bit-equal to decode steps) except where the strategy attends them
        # batched, and bf16-activation kernels turn last-bit differences into different tokens.
        raise ConfigError(f"speculative decoding (--drafter) over --kv-strategy {cfg.kv_strategy} is exact only with "
                          f"--weights fp32; the loaded weights are {model.weights_format} (pass --weights fp32, or --spec-k 0)")
    if cfg.drafter and cfg.spec_k and quantized and not getattr(model, "kernels_row_independent", True):
        raise ConfigError(f"speculative decoding (--drafter) with --weights {model.weights_format} is exact only on the CPU "
                          f"(row-independent kernels); on {cfg.device} pass --weights fp32, or --spec-k 0")
    if cfg.drafter == "ngram":
        from inference_engine.engine.prompt_lookup import PromptLookupDrafter

        drafter = PromptLookupDrafter()
    elif cfg.drafter:
        from kv_cache_proposer import load_drafter

        drafter = load_drafter(cfg.drafter, verifier_embed=model.embed, verifier_lm_head=model.lm_head, device=cfg.device,
                               weights="auto")
    resources = None
    if plugin.build_resources is not None:
        try:
            resources = plugin.build_resources(strategy, options, model=model, drafter=drafter, drafter_name=cfg.drafter,
                                               device=cfg.device)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    threads: int | None
    if cfg.threads == "auto" and model.backend_name == "mlx":
        threads = None  # --threads sets torch's intra-op threads; MLX schedules its own
    elif cfg.threads == "auto":
        from inference_engine.engine.tuning import fastest_thread_count

        threads, timings = fastest_thread_count(model)
        log.info("--threads auto: %d (median decode step by thread count: %s)", threads,
                 ", ".join(f"{n}: {1000 * t:.1f} ms" for n, t in timings.items()))
    elif isinstance(cfg.threads, str):  # validate() lets through a count, None or auto only
        raise ConfigError(f"--threads takes a count >= 1 or auto, got {cfg.threads!r}")
    else:
        threads = cfg.threads
    if getattr(model, "native_step", None) is not None:  # --compile auto on the CPU: kept where it measures faster
        from inference_engine.backends.torch import native
        from inference_engine.engine.tuning import native_step_pays

        kept = native.kept_verdict(model, threads)
        if kept is not None:
            pays, med, when = True, kept, "measured at an earlier start on this machine"
        else:
            pays, med = native_step_pays(model, threads)
            when = "measured now" + ("; kept for the next start" if native.keep_verdict(model, threads, med) else "")
        log.info("--compile auto: the native CPU row step %s (median decode step %.2f ms, the Python pieces %.2f ms, %s)",
                 "kept" if pays else "off: slower here", 1000 * med["native"], 1000 * med["python"], when)
        if not pays:
            model.use_native_step(False)
    try:
        return Engine(model, strategy, prefill_chunk=cfg.prefill_chunk, max_threads=threads,
                      drafter=drafter, spec_k=cfg.spec_k if drafter is not None else 0, drafter_name=cfg.drafter or "",
                      strategy_resources=resources, batching=cfg.batching, prefill_chunk_shared=cfg.prefill_chunk_shared,
                      model_thread=model_thread)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def build_runtime(cfg: ServeConfig, model=None) -> Runtime:
    """The model is loaded (unless given), tuned and wrapped on the model thread, which then runs
    every forward of this runtime's engine; the persister is built there too, so the calling
    thread runs no torch work of its own (start() then isolates the other threads)."""
    mt = model_thread()
    engine = mt.call(lambda: build_engine(cfg, model if model is not None else _load_model(cfg), model_thread=mt))
    persister = mt.call(lambda: build_persister(cfg, engine))
    mt.call(lambda: warm(engine, persister))
    return Runtime(engine, capacity=cfg.capacity, idle_ttl_s=cfg.idle_ttl, persister=persister,
                   max_append_tokens=cfg.max_append_tokens, max_pending_tokens=cfg.max_pending_tokens)


def warm(engine, persister) -> None:
    """One-time costs paid before the daemon says READY, not on a client's first turn: a scratch
    forward of each step kind (engine/tuning.py warm_up) and the persister's session template
    (what a load after a restart builds first)."""
    from inference_engine.engine.tuning import warm_up

    log.info("warm-up forward: %.2f s", warm_up(engine))
    cost = engine.measure_verify_cost()
    if cost is not None:
        log.info("steps drafting 1..%d tokens cost %s decode steps here, the draft %.2f of them (measured; the draft "
                 "gate weighs acceptance against it)", engine.spec_k, ", ".join(f"{c:.2f}" for c in cost[1:]),
                 engine.draft_cost)
    if persister is not None:
        persister.prepare_loads()


def freeze_startup_objects() -> float:
    """`kakeya serve`, before READY: move what start-up made (the model, its libraries' modules: ~390k objects
    with SmolLM2 and transformers loaded) into Python's permanent generation. A full collection walked them all,
    ~240 ms on the CPU we measure on, holding the GIL on whichever thread allocated (often the model thread,
    mid-turn): a latency spike every so often that nothing in the step explains. Later collections walk only
    what serving allocates. Returns the seconds the last full collection took."""
    import gc
    import time

    t = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t
    gc.freeze()
    log.info("froze %d start-up objects out of later collections (a full collection of them took %.0f ms)",
             gc.get_freeze_count(), took * 1e3)
    return took


def build_persister(cfg: ServeConfig, engine):
    """--persist turn: sessions saved under --state-dir (inference_engine/persistence); off: None."""
    if cfg.persist == "off":
        return None
    if cfg.persist != "turn":
        raise ConfigError(f"--persist must be 'off' or 'turn', got {cfg.persist!r}")
    from inference_engine.persistence.session_files import SessionFiles
    from inference_engine.persistence.state_dir import StateDir

    try:
        return SessionFiles(StateDir(cfg.state_dir), engine, exclusive=not cfg.shared_state_dir, shared=cfg.shared_state_dir,
                            lease_ttl_s=cfg.lease_ttl)
    except OSError as e:
        raise ConfigError(f"--state-dir {cfg.state_dir or StateDir().root}: {e}") from e


class RunningServer:
    def __init__(self, grpc_server, port: int, runtime: Runtime, stoppers):
        self.grpc_server, self.port, self.runtime, self._stoppers = grpc_server, port, runtime, stoppers

    def stop(self, grace: float | None = 1.0) -> None:
        for stop in self._stoppers:
            stop()
        self.grpc_server.stop(grace).wait()
        close = getattr(self.runtime.persister, "close", None)
        if close is not None:  # releases the state directory: a new daemon can take it, in this process too
            close()

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()


# grpc's default SO_REUSEPORT lets a second daemon bind a port another one serves, and the kernel then
# splits new connections between the two (clients reach the wrong daemon's sessions): with it off, a
# bind to a port in use fails.
GRPC_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


def bind_grpc(server, bind: str) -> int:
    """Bind `server` to `bind`; the bound port (the one picked for port 0). ConfigError when taken."""
    try:
        port = server.add_insecure_port(bind)
    except RuntimeError:  # grpcio >= 1.60 raises where older ones returned 0
        port = 0
    if port == 0:
        raise ConfigError(f"--bind {bind}: the address is already in use (is another kakeya daemon serving it?) or is "
                          f"not an address of this machine; stop the other process or pass another --bind HOST:PORT")
    return port


def check_port_free(flag: str, host: str, port: int) -> None:
    """Refuse early a side port (--http-port, --metrics-port) that something already listens on."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind it: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ConfigError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror}); free it or pass another port") from e


def check_before_loading(cfg: ServeConfig) -> None:
    """The refusals that need no model, made before the seconds (or minutes) a model load costs:
    the options (ServeConfig.validate), the side ports, and the state directory's lock (a check: the
    persister built after the load takes the lock for good)."""
    cfg.validate()
    host, _ = split_bind(cfg.bind)
    for flag, port in (("--http-port", cfg.http_port), ("--metrics-port", cfg.metrics_port)):
        if port:
            check_port_free(flag, host or "127.0.0.1", port)
    if cfg.persist == "turn":
        from inference_engine.persistence.state_dir import StateDir

        state_dir = StateDir(cfg.state_dir)
        try:
            state_dir.create()
            if not cfg.shared_state_dir:  # a shared directory is not held by one daemon: its sessions' leases are
                state_dir.lock().close()
        except OSError as e:
            raise ConfigError(f"--state-dir {state_dir.root}: {e}") from e


def spill_dir(cfg: ServeConfig) -> str | None:
    """Where the paged page store's spill files go (its pages past --page-ram-mb): --page-spill-dir, else
    <state dir>/spill when sessions are persisted, else None (the system temp dir)."""
    import os

    if cfg.page_spill_dir:
        return os.path.expanduser(cfg.page_spill_dir)
    if cfg.persist == "turn":
        from inference_engine.persistence.state_dir import StateDir

        return str(StateDir(cfg.state_dir).root / "spill")
    return None


def use_spill_dir(cfg: ServeConfig) -> str | None:
    """Set the process's spill directory (kv/paged_store.set_spill_dir) to spill_dir(cfg), created and tried
    with a scratch file first: a directory the daemon cannot write to is refused at start, not at the first
    session that outgrows --page-ram-mb. Spill files are unlinked as they are created, so it stays empty."""
    import os
    import tempfile

    from inference_engine.kv.paged_store import set_spill_dir

    path = spill_dir(cfg)
    try:
        if path is not None:
            os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix="kakeya-spill-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"--page-spill-dir {path or tempfile.gettempdir()}: {e}; pass another --page-spill-dir") from e
    set_spill_dir(path)
    return path


def start(cfg: ServeConfig, runtime: Runtime | None = None) -> RunningServer:
    """Serve `runtime` (built from `cfg` when not given: then every check that needs no model, and
    the port's bind, come before the model loads). gRPC and the wire stubs are imported here, not at
    the top: building an engine or a runtime in-process (benches, scripts/gpu_check.py) needs neither."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from inference_engine.server.grpc_service import ApiKeyInterceptor, RuntimeServicer, add_runtime_service
    from kakeya_wire.v1 import runtime_pb2 as pb

    check_exposure(cfg)
    if runtime is None:
        check_before_loading(cfg)
        use_spill_dir(cfg)  # process-wide, set once: before the engine that spills is built
    interceptors: list[grpc.ServerInterceptor] = [ApiKeyInterceptor(cfg.api_key)] if cfg.api_key else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers), interceptors=interceptors,
                         options=GRPC_SERVER_OPTIONS)
    port = bind_grpc(server, cfg.bind)  # held from here on: a second daemon on this port is refused at once
    try:
        runtime = runtime or build_runtime(cfg)
    except BaseException:
        server.stop(None)
        raise
    if cfg.malloc_trim and runtime.engine.loop.model_thread is not None:
        from inference_engine.server.host_memory import trim

        runtime.engine.loop.on_idle = trim  # freed heap back to the OS whenever the model thread runs out of work
    if runtime.model_info.backend == "torch" and runtime.engine.loop.model_thread is not None:
        from inference_engine.engine.model_thread import isolate_other_threads

        isolate_other_threads()  # RPC threads run their small torch ops inline: one OpenMP pool in the process
    add_runtime_service(RuntimeServicer(runtime), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_names = (pb.DESCRIPTOR.services_by_name["RuntimeService"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(service_names, server)
    stoppers = []
    try:  # side servers first: if one fails, nothing is left running
        if cfg.http_port:
            from inference_engine.server.http_shim import start_http_shim

            stoppers.append(start_http_shim(runtime, cfg))
        if cfg.metrics_port:
            host, _ = split_bind(cfg.bind)
            httpd, _thread = runtime.metrics.serve(cfg.metrics_port, addr=host or "127.0.0.1")
            stoppers.append(httpd.shutdown)
    except BaseException:
        for stop in stoppers:
            stop()
        server.stop(None)  # and the port goes back
        raise
    server.start()
    for name in ("", service_names[0]):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    # Idle-TTL eviction also happens on every store access; this sweeps quiet daemons.
    stop_sweep = threading.Event()

    def sweep():
        while not stop_sweep.wait(min(30.0, max(1.0, cfg.idle_ttl / 4))):
            runtime.store.evict_idle()

    threading.Thread(target=sweep, daemon=True, name="kakeya-ttl-sweep").start()
    stoppers.append(stop_sweep.set)
    stoppers.append(runtime.start_flusher())  # appended-but-idle sessions saved; the rest saved at stop
    stoppers.append(runtime.start_lease_keeper())  # shared state dir: heartbeat, and sessions other daemons ask for
    return RunningServer(server, port, runtime, stoppers)


def serve_forever(cfg: ServeConfig) -> int:
    # `kill -USR1 <pid>` writes every thread's stack to stderr (a daemon that hangs can say where); set before READY
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from inference_engine.server.host_memory import set_mmap_threshold

    if set_mmap_threshold(cfg.malloc_mmap_threshold_kb):  # the daemon process only, before anything large is allocated
        log.info("allocations of %d KiB and more get maps of their own (returned to the OS when freed)",
                 cfg.malloc_mmap_threshold_kb)
    running = start(cfg)
    freeze_startup_objects()  # the daemon process only: an embedding process (the tests) keeps its collector as is
    info = running.runtime.server_info()
    params = " ".join(f"{k}={v}" for k, v in sorted(info.kv_params.items()))
    log.info(
        "kakeya serving %s on %s (kv=%s %s, capacity=%d)%s",
        info.model_id, cfg.bind.rsplit(":", 1)[0] + f":{running.port}", info.kv_strategy, params, info.session_capacity,
        f", metrics on :{cfg.metrics_port}/metrics" if cfg.metrics_port else "",
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before READY: a supervisor's SIGTERM right after it stops us gracefully
        signal.signal(sig, lambda *_: done.set())
    print(f"READY {running.port}", flush=True)
    done.wait()
    running.stop(2.0)
    return 0
