"""One typed settings object, from defaults, then a TOML file, then RLBOOST_* environment variables.

Environment names are the dotted path upper-cased with `__` between levels, plus two short
aliases users expect: RLBOOST_NATS_URL and RLBOOST_REDIS_URL (= services.nats_url / redis_url).
Example: RLBOOST_WORKER__SLOTS=64 sets `worker.slots`.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec


class ConfigError(ValueError):
    """A config file or environment value that does not fit the settings schema."""


def default_data_dir() -> str:
    return str(Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "rlboost")


class AuthSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Identities the embedded/infra servers accept, one per role (see rlboost/auth.py). A role
    is on when it has a password or an nkey; its password is also its Redis ACL password."""

    trainer_user: str = "trainer"  # the trainer/manager: everything
    trainer_password: str = ""
    trainer_nkey: str = ""  # public user nkey (U...) instead of a password
    worker_user: str = "worker"  # rollout workers: consume requests, publish tokens/results/events
    worker_password: str = ""
    worker_nkey: str = ""
    worker_pools: str = "*"  # comma-separated pools the worker identity may serve; * = any
    tls_cert: str = ""  # server TLS certificate and key (PEM); empty = plain TCP
    tls_key: str = ""
    tls_ca: str = ""  # CA of client certificates: set to require mutual TLS


class ServicesSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    data_dir: str = msgspec.field(default_factory=default_data_dir)
    # Empty = use the embedded servers recorded in data_dir (started by `rlboost up`).
    nats_url: str = ""
    redis_url: str = ""
    bind: str = "127.0.0.1"  # embedded servers listen on loopback unless told otherwise
    # The identity THIS process connects as (a worker: the worker role's user and password).
    nats_user: str = ""
    nats_password: str = ""
    nats_nkey_seed: str = ""  # path to a user nkey seed file, instead of user/password
    nats_tls_ca: str = ""  # client TLS: CA bundle to verify the server; cert/key for mutual TLS
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    redis_user: str = ""  # Redis ACL user; empty = the `default` user
    redis_password: str = ""
    startup_timeout_s: float = 15.0
    # Server side: per-role identities and permissions (rlboost/auth.py). All empty = today's
    # behaviour (open servers, or the single nats_user/nats_password and redis_password).
    auth: AuthSettings = msgspec.field(default_factory=AuthSettings)


class WorkerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pool: str = "spot"
    engine: str = "emulated"
    slots: int = 32  # concurrent requests in the running batch
    resume_reserve: float = 0.5  # extra slots (x slots) kept for handed-off requests only
    handoff_pool: str = ""  # hand-offs go to this pool's resume lane ("" = our own): a reserved
    # seeding engine with its own queue hands its unfinished responses to the preemptible pool
    fetch_batch: int = 16  # fresh requests per pull: small pulls interleave between workers, so a
    # step spreads over the pool instead of filling whichever worker asked first (0 = all free slots)
    checkpoint_tokens: int = 16  # K: checkpoint + publish every K tokens ...
    checkpoint_ms: float = 250.0  # ... or every T ms, whichever first
    lease_ttl_s: float = 8.0  # < ack_wait, so a redelivered request's lease has expired
    heartbeat_s: float = 1.0
    drain_grace_s: float = 5.0
    ack_wait_s: float = 10.0
    max_deliver: int = 20
    model_dir: str = ""
    cache_dir: str = ""  # weight cache; empty = <data_dir>/weight-cache/<worker id>
    speed: float = 1.0  # emulated engine: >1 runs faster than the modelled H100, 0 = no sleeping
    gpus: int = 1  # emulated engine: GPUs behind this worker (data parallel; a spot instance = 2)
    token_scale: int = 1  # emulated engine: each emitted token stands for this many modelled tokens


class MetricsSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    port: int = 0  # Prometheus /metrics port (rlboost/metrics.py); 0 = off
    bind: str = "127.0.0.1"  # containers set 0.0.0.0 so Prometheus can scrape


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    services: ServicesSettings = msgspec.field(default_factory=ServicesSettings)
    worker: WorkerSettings = msgspec.field(default_factory=WorkerSettings)
    metrics: MetricsSettings = msgspec.field(default_factory=MetricsSettings)
    log_json: bool = False
    log_level: str = "info"


_ALIASES = {"RLBOOST_NATS_URL": ("services", "nats_url"), "RLBOOST_REDIS_URL": ("services", "redis_url"),
            "RLBOOST_DATA_DIR": ("services", "data_dir")}


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if name in _ALIASES:
            path: tuple[str, ...] = _ALIASES[name]
        elif name.startswith("RLBOOST_") and "__" in name:
            path = tuple(p.lower() for p in name[len("RLBOOST_"):].split("__"))
        elif name in ("RLBOOST_LOG_JSON", "RLBOOST_LOG_LEVEL"):
            path = (name[len("RLBOOST_"):].lower(),)
        else:
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def load_settings(path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Defaults < TOML file (explicit path, else $RLBOOST_CONFIG) < environment."""
    environ = dict(os.environ if environ is None else environ)
    path = path or environ.get("RLBOOST_CONFIG")
    data: dict[str, Any] = msgspec.to_builtins(Settings())
    if path:
        try:
            file_data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: {e}") from None
        _merge(data, file_data)
    _merge(data, _env_overrides(environ))
    try:
        # strict=False lets environment strings become ints, floats and booleans.
        return msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid setting: {e}") from None
