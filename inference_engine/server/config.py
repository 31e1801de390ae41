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


class ConfigError(ValueError):
    """A serve option the daemon cannot run with; the message names the option and the fix."""


@dataclass
class ServeConfig:
    bind: str = "127.0.0.1:50051"
    model: str = "smollm2-135m-instruct"
    kv_strategy: str = "sink_window"
    sink: int = 4
    window: int = 1020
    kv_compressor: str = "identity"  # identity | kakeya_d4 | kakeya_e8 (resident cache store)
    kv_dtype: str = "fp32"  # fp32 | int8: resident K/V rows of full / sink_window
    batching: str = "auto"  # auto | on | off: concurrent sessions' steps share forwards (auto = where exact: int8/int4)
    kv_q_range: int = 38  # lattice q_range of the kakeya compressors
    page_size: int = 64  # paged: tokens per page of evicted K/V
    recall_pages: int = 8  # paged: pages each query attends to besides sink and window
    page_compressor: str = "identity"  # paged: stored pages as identity | int8 | kakeya_d4 | kakeya_e8
    capacity: int = 16
    idle_ttl: float = 1800.0
    metrics_port: int = 0  # 0 = off
    http_port: int = 0  # 0 = off (deprecated OpenAI-style shim)
    api_key: str | None = None
    device: str = "cpu"
    compile: str = "auto"  # off | auto | on: the step as captured CUDA graphs (auto = on where it measures faster: CUDA)
    backend: str = "torch"  # torch | mlx (backends/mlx; needs the mlx extra)
    threads: int | str | None = None  # None = torch's choice, "auto" = fastest measured (engine/tuning.py)
    weights: str = "auto"  # fp32 | int8 | int4 | auto (int4 on cpu, fp32 elsewhere: scripts/bench_weights.py)
    prefill_chunk: int = 256
    prefill_chunk_shared: int = 32  # prefill chunk while other sessions generate (batching on; 0 = prefill_chunk)
    max_workers: int = 16
    drafter: str | None = None  # "ngram" (prompt lookup), a shipped drafter name or checkpoint dir; enables speculation
    spec_k: int = 4
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


def check_exposure(cfg: ServeConfig) -> None:
    host, _ = split_bind(cfg.bind)
    if not is_loopback(host) and not cfg.api_key:
        raise ConfigError(
            f"refusing to bind {cfg.bind} (not loopback) without an API key; pass --api-key or set KAKEYA_API_KEY"
        )
