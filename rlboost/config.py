"""One typed settings tree: defaults, then a TOML file, then RLBOOST_* environment variables,
then command-line overrides (`--trainer.lr 1e-5` or `trainer.lr=1e-5`).

Sections: [run] (what a run is: steps, seed, checkpoints, loggers), [trainer] (device,
precision, optimizer, schedule, memory), [algorithm] (the GRPO loss, its off-policy correction),
[rollout] (prompts, samples, the seeding window), [services], [worker], [metrics], [weights] (how
policy versions are stored: snapshots and sparse deltas), [endpoint] (`rlboost serve-openai`).
Environment names are the dotted path upper-cased with `__` between levels, plus two short
aliases users expect: RLBOOST_NATS_URL and RLBOOST_REDIS_URL (= services.nats_url / redis_url). Example:
RLBOOST_WORKER__SLOTS=64 sets `worker.slots`. Every value is validated when the tree is built,
with an error that names the key; relations between keys (a lease shorter than the ack wait) are
checked here too, not in one command's argument parser. `dump_toml` writes the effective
settings: a run started from that file is the same run.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from rlboost import wire
from rlboost.errors import RlboostError


class ConfigError(RlboostError, ValueError):
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
    worker_pools: str = "*"  # comma-separated pools the worker and env identities may serve; * = any
    env_user: str = "env"  # environment workers (`rlboost env-worker`): take tool calls, append results under a lease
    env_password: str = ""
    env_nkey: str = ""
    tls_cert: str = ""  # server TLS certificate and key (PEM); empty = plain TCP
    tls_key: str = ""
    tls_ca: str = ""  # CA of client certificates: set to require mutual TLS


class RetentionSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How long the servers keep what a run leaves behind (docs/reference/retention.md). A
    process that provisions the streams (the trainer, `rlboost up`, the endpoint) applies the
    stream ages; every process that writes checkpoints (workers too) applies `checkpoints_s`.
    Shorter windows bound the servers' memory and disk on a long run; a checkpoint must outlive
    the longest request and a result the trainer's longest pause (a resumed run reads the
    results of the step it stopped in)."""

    checkpoints_s: int = 86400  # Redis: a request's tokens, lease history and episode state, from its last claim
    # RB_RESULTS: finished rollouts (0 = forever). Forever by default: with an age on this stream
    # the 3-node cluster partition test (tests/test_partitions.py, nats_node_isolated) lost most
    # results, not yet understood; set it on a single node, where `rlboost bench soak` checks it.
    results_s: float = 0.0
    tokens_s: float = 7 * 86400.0  # RB_TOKENS: token deltas for streaming readers (0 = forever)
    events_s: float = 7 * 86400.0  # RB_EVENTS: worker and request events, provenance (0 = forever)
    dlq_s: float = 30 * 86400.0  # RB_DLQ: dead-lettered messages, kept for a person to read (0 = forever)

    def __post_init__(self) -> None:
        _check(self.checkpoints_s >= 60, "services.retention.checkpoints_s", "must be >= 60")
        for name in ("results_s", "tokens_s", "events_s", "dlq_s"):
            v = getattr(self, name)
            _check(v == 0 or v >= 60, f"services.retention.{name}", "must be 0 (forever) or >= 60")

    def stream_ages(self) -> dict[str, float]:
        """Max age per stream name, for `bus.provision` (0 = forever)."""
        return {wire.STREAM_RESULTS: self.results_s, wire.STREAM_TOKENS: self.tokens_s,
                wire.STREAM_EVENTS: self.events_s, wire.STREAM_DLQ: self.dlq_s}


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
    nats_cluster: int = 1  # `rlboost up --cluster N`: N JetStream nodes on loopback (streams at replication min(N, 3))
    nats_replicas: int = 1  # replication of the streams, KV buckets and object store a provisioner creates
    redis_sentinel: bool = False  # `rlboost up --sentinel`: Redis primary + replica + a sentinel that fails over
    redis_cluster: int = 0  # `rlboost up --redis-cluster N`: a Redis Cluster of N masters on loopback (N >= 2)
    redis_aof: bool = True  # embedded Redis: append-only file, fsync every second (false: keep nothing)
    # Server side: per-role identities and permissions (rlboost/auth.py). All empty = today's
    # behaviour (open servers, or the single nats_user/nats_password and redis_password).
    auth: AuthSettings = msgspec.field(default_factory=AuthSettings)
    retention: RetentionSettings = msgspec.field(default_factory=RetentionSettings)


class WorkerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pool: str = "spot"
    engine: str = "emulated"
    slots: int = 32  # concurrent requests in the running batch
    resume_reserve: float = 0.5  # extra slots (x slots) kept for handed-off requests only
    handoff_pool: str = ""  # hand-offs go to this pool's resume lane ("" = our own): a reserved
    # seeding engine with its own queue hands its unfinished responses to the preemptible pool
    parked_episodes: int = 32  # episodes in their environment phase (tools, the env's reply) that
    # hold no generation slot: the engine takes other requests meanwhile (0: each holds its slot)
    fetch_batch: int = 16  # fresh requests per pull: small pulls interleave between workers, so a
    # step spreads over the pool instead of filling whichever worker asked first (0 = all free slots)
    idle_pull_s: float = 2.0  # a lane that came back empty waits this long for its next request (one
    # at a time, returned on arrival) instead of polling every 0.25 / 0.5 s: an idle worker's pulls
    # were ~16 of its ~23 NATS messages a second (docs/benchmarks/scale.md)
    checkpoint_tokens: int = 16  # K: checkpoint + publish every K tokens ...
    checkpoint_ms: float = 250.0  # ... or every T ms, whichever first
    lease_ttl_s: float = 8.0  # < ack_wait, so a redelivered request's lease has expired
    heartbeat_s: float = 1.0
    stall_s: float = 15.0  # no engine step or flush for this long: stop extending (and fetching) requests
    publish_timeout_s: float = 2.0  # per ack; an unacknowledged publish is retried with its Nats-Msg-Id
    drain_grace_s: float = 5.0
    ack_wait_s: float = 10.0
    max_deliver: int = 20
    model_dir: str = ""
    # Engine options. torch: device, dtype (float64 default: reproducible), max_model_len;
    # vllm: dtype ("" = the model's on GPU, float32 on CPU), max_model_len (0 = the model's),
    # tensor_parallel_size, gpu_memory_utilization, enforce_eager.
    device: str = "cpu"
    dtype: str = ""
    max_model_len: int = 0
    # torch engine: keys and values of what each request fed, reused by its next call (its next
    # chunk, an episode's next turn) instead of feeding the whole context again; 0 = off
    prefix_cache_mb: float = 256.0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool | None = None  # None: CUDA graphs on a GPU, eager on CPU
    cache_dir: str = ""  # weight cache; empty = <data_dir>/weight-cache/<worker id>
    speed: float = 1.0  # emulated engine: >1 runs faster than the modelled H100, 0 = no sleeping
    gpus: int = 1  # emulated engine: GPUs behind this worker (data parallel; a spot instance = 2)
    token_scale: int = 1  # emulated engine: each emitted token stands for this many modelled tokens
    emulated_pulls: bool = False  # emulated engine: pull each version's shards anyway (fault benches)

    def __post_init__(self) -> None:
        _check(self.prefix_cache_mb >= 0, "worker.prefix_cache_mb", "must be >= 0 (0 = off)")
        # A redelivered request must find its old lease expired, or the new worker is refused.
        _check(self.lease_ttl_s < self.ack_wait_s, "worker.lease_ttl_s",
               f"{self.lease_ttl_s} must be < worker.ack_wait_s ({self.ack_wait_s})")
        _check(self.slots > 0, "worker.slots", "must be > 0")
        _check(self.idle_pull_s >= 0, "worker.idle_pull_s", "must be >= 0 (0 = poll at the lanes' lingers)")
        _check(self.checkpoint_tokens > 0, "worker.checkpoint_tokens", "must be > 0")
        _check(self.parked_episodes >= 0, "worker.parked_episodes", "must be >= 0")


class DataSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`rlboost run`'s data and reward (docs/guides/your-model.md); the
    command-line flags of the same names override these."""

    task: str = ""  # built-in task: addition (generated; the demo) | math; "" = addition without --data
    train: str = ""  # JSONL / Parquet file or a datasets.save_to_disk folder ("" = the task's generator)
    eval: str = ""  # held-out file; "" = a seeded eval_fraction of train
    reward: str = ""  # module:fn | path/to/file.py:fn | a built-in task's name; "" = the task's
    max_prompt_tokens: int = 1024  # longer ones are filtered (counted, logged); 0 = the context only
    max_response_tokens: int = 0  # 0 = the task's (addition: longest answer + EOS), else 512, at most half the context
    eval_size: int = 256
    eval_fraction: float = 0.1
    shuffle: bool = True
    epochs: int = 0  # 0 = as many as the steps need
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    ground_truth_key: str = ""  # "" = ground_truth, else answer, else reward_model.ground_truth
    data_source_key: str = "data_source"
    reward_workers: int = 2
    reward_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        from rlboost.wire import MAX_NEW_TOKENS

        _check(self.max_prompt_tokens >= 0, "data.max_prompt_tokens", "must be >= 0 (0 = only the model's context)")
        _check(0 <= self.max_response_tokens <= MAX_NEW_TOKENS, "data.max_response_tokens",
               f"must be between 0 (the default) and {MAX_NEW_TOKENS}")


class MetricsSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    port: int = 0  # Prometheus /metrics port (rlboost/metrics.py); 0 = off
    bind: str = "127.0.0.1"  # containers set 0.0.0.0 so Prometheus can scrape


LOGGERS = ("tensorboard", "wandb")


class RunSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one training run is. `rlboost run` flags (--steps, --seed, ...) are shorthands for these."""

    policy: str = "hybrid"  # hybrid | colocated | disaggregated
    steps: int = 40
    max_minutes: float = 0.0  # stop after the step that crosses this (0 = no limit)
    seed: int = 0
    eval_every: int = 5
    run_dir: str = ""  # empty: runs/<time>
    run_id: str = ""  # empty: a new one (a resumed run keeps its own)
    model_dir: str = ""  # a Hugging Face causal-LM folder (read only); empty: <data_dir>/model, built if missing
    init_model: bool = False  # build the demo model into model_dir first if it is missing
    workers: int = 2  # preemptible worker processes the run starts itself
    nproc: int = 1  # trainer ranks (FSDP2 under torchrun); 1 = one process, no torch.distributed
    checkpoint_every: int = 10  # steps between training checkpoints (0 = only at the end)
    keep_checkpoints: int = 2  # the newest K are kept
    loggers: list[str] = msgspec.field(default_factory=list)  # "tensorboard", "wandb"
    wandb_project: str = "rlboost"
    wandb_mode: str = "offline"  # offline (no network needed; `wandb sync` later) | online
    save_rollouts: bool = False
    shuffle_rewards: bool = False  # control: rewards shuffled within each group
    chaos: str = ""  # e.g. "3:term,5:kill": worker signals mid-step (benches)
    # the demo model's warm start (trainer/bootstrap.py): until two checks settle at this held-out accuracy
    bootstrap_target: float = 0.35
    bootstrap_seconds: float = 900.0  # its time cap: ~2 min on an idle 2-core box, several on a busy one
    # `--env`'s demo model: stop its warm start after this many steps (0 = no cap). Unlike the
    # seconds, a step count gives the same model on a loaded box as on an idle one
    bootstrap_steps: int = 0
    # `--env`'s demo model, after its warm start: this many steps more (at a tenth of the rate) on
    # demonstrations of which `bootstrap_guess_share` answer at once, without the tools. The model
    # keeps the skill but seldom uses it, as a base model that guesses: RL has to teach it when
    # the tools pay (docs/concepts/environments.md). 0 = none: RL starts from a tool imitator
    bootstrap_guess_steps: int = 200
    bootstrap_guess_share: float = 0.8
    # The run lease (rlboost/runlease.py): one run per set of servers. A run renews it every third
    # of this; a run killed without a chance to release it (SIGKILL, a lost machine) blocks its
    # servers this long at most. Kept by the servers for all runs: the last run to take it sets it
    lease_ttl_s: float = 20.0
    gpu_hour_dollars: float = 0.0  # price of the trainer's reserved capacity; 0 = no cost metric
    worker_hour_dollars: float = 0.0  # price of one preemptible worker

    def __post_init__(self) -> None:
        _check(self.policy in ("hybrid", "colocated", "disaggregated"), "run.policy",
               f"{self.policy!r}: use hybrid, colocated or disaggregated")
        _check(self.steps > 0, "run.steps", "must be > 0")
        _check(self.nproc >= 1, "run.nproc", "must be >= 1")
        _check(self.checkpoint_every >= 0, "run.checkpoint_every", "must be >= 0")
        _check(self.keep_checkpoints >= 1, "run.keep_checkpoints", "must be >= 1")
        _check(self.eval_every >= 1, "run.eval_every", "must be >= 1")
        _check(self.bootstrap_steps >= 0, "run.bootstrap_steps", "must be >= 0 (0 = no cap)")
        _check(self.bootstrap_guess_steps >= 0, "run.bootstrap_guess_steps", "must be >= 0 (0 = no guessing phase)")
        # at 1 the model would never call a tool again, and RL would never see one that pays
        _check(0.0 <= self.bootstrap_guess_share < 1.0, "run.bootstrap_guess_share", "must be in [0, 1)")
        # under 1 s a renewal (every third) races the servers' expiry; over an hour a dead run blocks too long
        _check(1.0 <= self.lease_ttl_s <= 3600.0, "run.lease_ttl_s", "must be in [1, 3600] seconds")
        bad = [x for x in self.loggers if x not in LOGGERS]
        _check(not bad, "run.loggers", f"unknown {bad}: use {list(LOGGERS)}")
        _check(self.wandb_mode in ("offline", "online", "disabled"), "run.wandb_mode", "offline | online | disabled")


class TrainerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Device, precision, optimizer and memory of the policy update."""

    device: str = "auto"  # auto (cuda if present, else cpu) | cpu | cuda | cuda:N
    # auto: bf16 on CUDA, fp32 on CPU. bf16 = bf16 compute, fp32 master weights and optimizer
    # state; fp64 = deterministic (bench reproduce: identical weights whatever the arrival order)
    precision: str = "auto"
    lr: float = 1e-4
    weight_decay: float = 0.0  # AdamW, decoupled; norms and biases are never decayed
    betas: list[float] = msgspec.field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    warmup_steps: int = 0  # linear warm-up from 0 to lr
    lr_schedule: str = "constant"  # constant | cosine | linear (after warm-up, to min_lr_ratio * lr)
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    # When a group is back-propagated: `arrival` = as soon as it is in (training overlaps the
    # rollout tail; the gradient sum's order follows arrival, so fp32 rounding may differ run to
    # run); `ordered` = in group order (an early group waits as tokens), the same sum whatever
    # the arrival order; auto = ordered in fp64 (the deterministic mode), arrival otherwise.
    group_order: str = "auto"
    micro_batch_tokens: int = 4096  # prompt + response tokens per forward/backward pass
    activation_checkpointing: bool = False  # recompute layer activations in backward: less memory
    # dtype of the published weights, cast from the master weights: auto = bf16 for a bf16 model
    # (config.json's torch_dtype) or bf16 training, else fp32
    publish_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "trainer.device",
               f"{self.device!r}: use auto, cpu, cuda or cuda:N")
        _check(self.precision in ("auto", "bf16", "fp32", "fp64"), "trainer.precision",
               f"{self.precision!r}: use auto, bf16, fp32 or fp64")
        _check(self.lr > 0, "trainer.lr", "must be > 0")
        _check(self.weight_decay >= 0, "trainer.weight_decay", "must be >= 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "trainer.betas",
               "two values in [0, 1)")
        _check(self.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
        _check(self.lr_schedule in ("constant", "cosine", "linear"), "trainer.lr_schedule",
               f"{self.lr_schedule!r}: use constant, cosine or linear")
        _check(0 <= self.min_lr_ratio <= 1, "trainer.min_lr_ratio", "must be in [0, 1]")
        _check(self.grad_clip >= 0, "trainer.grad_clip", "must be >= 0")
        _check(self.micro_batch_tokens > 0, "trainer.micro_batch_tokens", "must be > 0")
        _check(self.group_order in ("auto", "arrival", "ordered"), "trainer.group_order",
               f"{self.group_order!r}: use auto, arrival or ordered")
        _check(self.publish_dtype in ("auto", "bf16", "fp16", "fp32"), "trainer.publish_dtype",
               f"{self.publish_dtype!r}: use auto, bf16, fp16 or fp32")


class WeightsSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How policy versions are stored in the weight store (rlboost/weights/)."""

    deltas: bool = True  # store a version as a sparse delta against the previous one when it pays
    delta_max_ratio: float = 0.5  # a delta pays when its bytes are at most this fraction of the full version
    full_every: int = 10  # a full snapshot at least every N versions (bounds a late joiner's replay)
    # how a delta is coded (rlboost/weights/deltas.py): "sparse3" (positions by magnitude class,
    # about a quarter fewer bytes than sparse2 at lr 1e-6) or "sparse2", the format before, which
    # workers older than sparse3 read: for a fleet upgraded while the trainer publishes
    delta_format: str = "sparse3"
    # opt-in: a delta-only version also carries its change from the last snapshot when that is fewer
    # bytes than the deltas since, so a late joiner replays one delta; the publisher keeps the snapshot
    # in memory, encodes each version twice and uploads 2.7-3.3x the bytes (publish 0.50 -> 1.44 s on the
    # bench) for a late-joiner gain within the bench's noise: worth it when many instances join late
    # and the trainer has CPU and host memory to spare (rlboost/weights/publisher.py)
    snapshot_deltas: bool = False
    keep_versions: int = 3  # GC keeps the newest N versions, plus every version they need
    # where versions live: "" = the embedded JetStream Object Store; "s3://bucket/prefix" = an
    # S3-compatible bucket (pip install 'rlboost[s3]'; credentials from AWS_ACCESS_KEY_ID etc.);
    # "file:///path" or a path = a directory (local disk or a mount every worker sees)
    store: str = ""
    s3_endpoint: str = ""  # S3 API endpoint URL (MinIO, Ceph, R2); "" = AWS or $AWS_ENDPOINT_URL
    s3_region: str = ""  # "" = $AWS_REGION / $AWS_DEFAULT_REGION, else us-east-1
    # Peers (rlboost/weights/peers.py, docs/concepts/versions.md): each worker serves the blobs
    # its cache holds verified to the others, and pulls from them before the store
    peers: bool = False
    peer_host: str = "127.0.0.1"  # address the peer server binds; any non-loopback one needs a token
    peer_port: int = 0  # 0 = a free port (advertised in the rb-peers KV bucket)
    peer_advertise: str = ""  # host the other workers reach this one at; "" = peer_host (required for 0.0.0.0 / ::)
    peer_token_env: str = "RLBOOST_PEER_TOKEN"  # environment variable holding the peers' shared bearer token
    peer_max_serving: int = 4  # blobs served at once; more requests are answered 503 (tried elsewhere)
    peer_tries: int = 3  # holders asked per round for one blob before claiming it from the store
    peer_wait_s: float = 30.0  # a blob nobody can serve for this long is read from the store directly

    def __post_init__(self) -> None:
        _check(0 <= self.peer_port <= 65535, "weights.peer_port", "must be in [0, 65535]")
        _check(self.peer_max_serving >= 1, "weights.peer_max_serving", "must be >= 1")
        _check(self.peer_tries >= 1, "weights.peer_tries", "must be >= 1")
        _check(self.peer_wait_s >= 0, "weights.peer_wait_s", "must be >= 0")
        _check(self.peer_advertise or self.peer_host not in ("0.0.0.0", "::", ""), "weights.peer_advertise",
               f"peer_host {self.peer_host!r} binds every interface: say which address the others reach this worker at")
        _check(0 < self.delta_max_ratio <= 1, "weights.delta_max_ratio", "must be in (0, 1]")
        _check(self.full_every >= 1, "weights.full_every", "must be >= 1")
        _check(self.delta_format in ("sparse3", "sparse2"), "weights.delta_format",
               f"{self.delta_format!r}: use sparse3, or sparse2 for workers older than sparse3")
        _check(self.keep_versions >= 1, "weights.keep_versions", "must be >= 1")
        if self.store.startswith("s3://"):
            from rlboost.wire import parse_s3_url

            try:
                parse_s3_url(self.store)
            except ValueError as e:
                _check(False, "weights.store", str(e))
        else:
            _check("://" not in self.store or self.store.startswith("file://"), "weights.store",
                   f"{self.store!r}: use s3://bucket/prefix, file:///path, a path, or empty (JetStream)")
        _check(not self.s3_endpoint or self.s3_endpoint.startswith(("http://", "https://")),
               "weights.s3_endpoint", f"{self.s3_endpoint!r} is not an http(s):// URL")

    def publisher_options(self) -> dict:
        return {"deltas": self.deltas, "delta_max_ratio": self.delta_max_ratio, "full_every": self.full_every,
                "delta_format": self.delta_format, "snapshot_deltas": self.snapshot_deltas,
                "keep_versions": self.keep_versions}

    def store_options(self) -> dict:
        """`rlboost.weights.open_store` keyword arguments for the configured backend."""
        return {"url": self.store, "s3_endpoint": self.s3_endpoint, "s3_region": self.s3_region}

    def store_env(self) -> dict[str, str]:
        """The store's keys (and the peers' when they are on) as RLBOOST_WEIGHTS__* variables, for
        a process this one starts."""
        env = {f"RLBOOST_WEIGHTS__{k.upper()}": v for k, v in
               (("store", self.store), ("s3_endpoint", self.s3_endpoint), ("s3_region", self.s3_region)) if v}
        if self.peers:
            env.update({f"RLBOOST_WEIGHTS__{k.upper()}": str(getattr(self, k)).lower() if k == "peers" else
                        str(getattr(self, k)) for k in self.__struct_fields__ if k == "peers" or k.startswith("peer_")})
        return env


OFF_POLICY = ("none", "tis", "decoupled")  # algorithm.off_policy


class AlgorithmSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The GRPO objective."""

    clip_eps: float = 0.2  # PPO ratio clip
    kl_coef: float = 0.0  # KL to the initial policy (k3); the reference is loaded only when > 0
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    # Off-policy correction from the engines' recorded (behaviour) logprobs mu, for tokens sampled
    # by another policy than the one trained (stale versions in partial/async rollout, or an
    # engine whose numerics differ from the trainer's). `none`: PPO clip around mu, as always;
    # `tis` (verl's truncated IS): clip around the trainer's own logprobs pi_old, each token's
    # loss weighted by min(pi_old/mu, is_cap); `decoupled` (AReaL): the same clip, weight
    # pi_old/mu, tokens whose weight exceeds is_cap dropped from the gradient.
    off_policy: str = "none"
    is_cap: float = 2.0  # tis: the truncation C; decoupled: the drop threshold; none: only counted
    # Episodes whose environment gives per-turn rewards (`Score.turn_rewards`, `Reply.turn_reward`):
    # each model turn's tokens get the episode's advantage plus this times the turn's reward
    # normalised over the group's episodes that reached that turn (turn-level credit, as MT-GRPO);
    # 0 trains on the episode reward alone. Single-turn runs and environments without turn rewards
    # are unaffected.
    turn_reward_coef: float = 1.0

    def __post_init__(self) -> None:
        _check(0 < self.clip_eps < 1, "algorithm.clip_eps", "must be in (0, 1)")
        _check(self.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0")
        _check(self.entropy_coef >= 0, "algorithm.entropy_coef", "must be >= 0")
        _check(math.isfinite(self.turn_reward_coef) and self.turn_reward_coef >= 0, "algorithm.turn_reward_coef",
               "must be a number >= 0")
        _check(self.off_policy in OFF_POLICY, "algorithm.off_policy",
               f"{self.off_policy!r}: use {', '.join(OFF_POLICY)}")
        # a cap of 1 or less would cut or drop on-policy tokens too (their ratio is 1 give or take rounding)
        _check(math.isfinite(self.is_cap) and self.is_cap > 1, "algorithm.is_cap", "must be a number > 1")


class RolloutSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a step asks of the rollout side."""

    prompts: int = 32  # groups per step
    samples: int = 8  # responses per prompt (the group)
    temperature: float = 1.0
    slots: int = 32  # batch slots of the run's own workers and reserved engine
    checkpoint_tokens: int = 16  # K of the run's own workers
    t_seed: float = 2.0  # initial seeding window (s)
    t_seed_floor: float = 0.5
    # rlboost.orchestrator: sync (on-policy, RLBoost's step) | partial (a step trains on the first
    # `prompts` complete groups of prompts x (1 + overprovision) in flight; the others continue
    # under the next version) | async (the next max_staleness steps are published ahead)
    mode: str = "sync"
    max_staleness: int = 1  # async: versions a trained token may lag; partial: recorded only
    overprovision: float = 0.25  # partial: extra groups kept in flight
    # async: a worker moving to a newer version carries its unfinished requests along (their later
    # tokens a segment of that version; the staleness bound holds) instead of finishing them first
    in_flight_updates: bool = True
    # the reserved side's seeding engine: in this process, or an `rlboost worker` process on the
    # reserved pool; torch | vllm | emulated. vllm_sleep: free the GPU while the trainer trains
    # (vLLM sleep mode, GPUs only: refused where the engine cannot sleep)
    seeding: str = "in_process"
    seeding_engine: str = "torch"
    vllm_sleep: bool = False

    def __post_init__(self) -> None:
        _check(self.mode in ("sync", "partial", "async"), "rollout.mode", f"{self.mode!r}: use sync, partial or async")
        _check(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0")
        _check(self.overprovision >= 0, "rollout.overprovision", "must be >= 0")
        _check(self.seeding in ("in_process", "process"), "rollout.seeding",
               f"{self.seeding!r}: use in_process or process")
        _check(self.seeding_engine in ("torch", "vllm", "emulated"), "rollout.seeding_engine",
               f"{self.seeding_engine!r}: use torch, vllm or emulated")
        _check(self.prompts > 0, "rollout.prompts", "must be > 0")
        _check(self.samples > 0, "rollout.samples", "must be > 0")
        _check(self.temperature > 0, "rollout.temperature", "must be > 0")
        _check(0 <= self.t_seed_floor <= self.t_seed, "rollout.t_seed_floor",
               f"{self.t_seed_floor} must be in [0, rollout.t_seed ({self.t_seed})]")


class EndpointSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`rlboost serve-openai`: an OpenAI-compatible chat-completions endpoint whose every call is
    a checkpointed rollout request (rlboost/endpoint/, docs/guides/agent-harnesses.md)."""

    host: str = "127.0.0.1"  # loopback unless told otherwise; any other address needs a token
    port: int = 8000  # 0 = a free port (printed at start)
    token_env: str = "RLBOOST_ENDPOINT_TOKEN"  # environment variable holding the bearer token ("" in it = no auth, loopback only)
    model_name: str = "rlboost"  # the model id GET /v1/models lists and responses name
    model_dir: str = ""  # the tokenizer and chat template come from here; "" = run.model_dir, else <data_dir>/model
    pool: str = "spot"  # the worker pool whose queue each call is published on
    step: int = 99999  # the step number of the endpoint's requests: one a training run does not reach
    run_dir: str = ""  # where each session's calls are recorded (sessions/<id>.jsonl); "" = runs/endpoint-<time>
    max_tokens: int = 4096  # the largest max_tokens a call may ask for
    default_max_tokens: int = 512  # a call that names none
    max_n: int = 16  # choices per call (n)
    max_body_bytes: int = 8 << 20  # a larger HTTP body is refused (413)
    max_inflight: int = 256  # calls waiting at once; more are refused (429)
    request_timeout_s: float = 600.0  # a call whose results are not in by then is answered 504

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "endpoint.port", "must be in [0, 65535]")
        _check(self.step >= 0, "endpoint.step", "must be >= 0")
        _check(self.default_max_tokens >= 1, "endpoint.default_max_tokens", "must be >= 1")
        _check(self.default_max_tokens <= self.max_tokens, "endpoint.max_tokens",
               f"{self.max_tokens} must be >= endpoint.default_max_tokens ({self.default_max_tokens})")
        _check(self.max_n >= 1, "endpoint.max_n", "must be >= 1")
        _check(self.max_body_bytes >= 1024, "endpoint.max_body_bytes", "must be >= 1024")
        _check(self.max_inflight >= 1, "endpoint.max_inflight", "must be >= 1")
        _check(self.request_timeout_s > 0, "endpoint.request_timeout_s", "must be > 0")


class HarnessSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`rlboost run --harness CMD`: an agent harness of the user's own, one process per session,
    trained through the run's OpenAI-compatible endpoint (rlboost.trainer.harness_task,
    docs/guides/agent-harnesses.md). Each process gets OPENAI_BASE_URL, OPENAI_API_KEY (its
    session's key), RLBOOST_SESSION and its row as JSON in RLBOOST_TASK."""

    command: str = ""  # the harness's command line (run by the shell, in the run's working directory); "" = no harness
    concurrency: int = 0  # harness processes running at once; 0 = a step's sessions (rollout.prompts x rollout.samples), the held-out ones as many at a time
    session_timeout_s: float = 600.0  # a harness process running longer is killed: its session is lost (harness_lost)
    kill_grace_s: float = 5.0  # SIGTERM, then this long, then SIGKILL (the process group)
    host: str = "127.0.0.1"  # where the run's endpoint binds (loopback: the harnesses run on this machine)
    port: int = 0  # 0 = a free port
    eval: bool = True  # the held-out rows are evaluated by the harness too (RLBOOST_EVAL=1: it may sample greedily)

    def __post_init__(self) -> None:
        _check(self.concurrency >= 0, "harness.concurrency", "must be >= 0 (0 = a step's sessions)")
        _check(self.session_timeout_s > 0, "harness.session_timeout_s", "must be > 0")
        _check(self.kill_grace_s >= 0, "harness.kill_grace_s", "must be >= 0")
        _check(0 <= self.port <= 65535, "harness.port", "must be in [0, 65535]")


class EnvSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Episodes: which environment a run's requests play in (`rlboost run --env`), and the
    bounds every episode keeps (docs/concepts/environments.md)."""

    ref: str = ""  # module:fn | path/to/file.py:fn | a built-in (calculator, reasoning-gym, textarena, gymnasium); "" = single-turn
    options: dict[str, Any] = msgspec.field(default_factory=dict)  # keyword arguments of fn ([env.options] game = "...")
    tool_timeout_s: float = 30.0  # a tool call running longer counts as a failed call (env.on_tool_error); start / respond: env_error, score: 0
    on_tool_error: str = "message"  # a tool that raises or times out: message (the model reads the error) | end (the episode)
    max_turns: int = 8  # model turns per episode; a turn past it ends the episode (its tool calls are not run)
    max_episode_tokens: int = 4096  # prompt + model + environment tokens; no room for one more model token ends it
    # Where tool calls run. true: in the generation worker, beside its engine (an episode in its
    # tools holds no generation slot, up to `worker.parked_episodes`). false: on the environment
    # pool (`rlboost env-worker` processes, CPU machines): the generation worker releases the
    # episode at each tool call and takes other work. The default and why: docs/concepts/environments.md.
    inline: bool = True
    pool_slots: int = 64  # an environment worker: episodes whose tools it runs at once
    env_workers: int = 1  # `rlboost run` with inline = false: environment worker processes it starts
    describe_tools: bool = True  # the tools' full JSON specs in the opening; false: a chat template gets brief ones (name, first line, argument names: a 512-token model's prompt fits), the fallback format none (a small model that learned its tools from warm-start data)

    def __post_init__(self) -> None:
        # msgspec turns a ValueError of __post_init__ into a ValidationError that names it
        if self.on_tool_error not in ("message", "end"):
            raise ValueError(f"env.on_tool_error: {self.on_tool_error!r} must be message or end")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"env.tool_timeout_s: {self.tool_timeout_s} must be > 0")
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns: {self.max_turns} must be >= 1")
        if self.max_episode_tokens < 1:
            raise ValueError(f"env.max_episode_tokens: {self.max_episode_tokens} must be >= 1")
        if self.pool_slots < 1:
            raise ValueError(f"env.pool_slots: {self.pool_slots} must be >= 1")
        if self.env_workers < 0:
            raise ValueError(f"env.env_workers: {self.env_workers} must be >= 0")


class FleetSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How many preemptible instances to rent (rlboost/fleet_policy.py): exported as
    `rlboost_fleet_desired_workers` for a scaler to follow, and used by `rlboost bench trace --fleet`."""

    policy: str = "all"  # all | fixed | cost
    max_instances: int = 0  # never more than this (0 = no cap)
    fixed: int = 3  # policy = "fixed": this many
    reserved_dollars_per_hour: float = 83.76  # the reserved cluster (8 x $10.47/GPU-h, RLBoost's evaluation)
    instance_dollars_per_hour: float = 5.32  # one preemptible instance (2 x $2.66/GPU-h)
    hysteresis: float = 0.02  # cost: move only for more than this relative gain in tokens/s per $/h
    min_tokens_per_s: float = 0.0  # cost: a throughput floor (0 = none)
    max_dollars_per_hour: float = 0.0  # cost: a $/h ceiling for the whole run (0 = none)

    def __post_init__(self) -> None:
        _check(self.policy in ("all", "fixed", "cost"), "fleet.policy", f"{self.policy!r}: use all, fixed or cost")
        _check(self.max_instances >= 0, "fleet.max_instances", "must be >= 0 (0 = no cap)")
        _check(self.fixed >= 0, "fleet.fixed", "must be >= 0")
        _check(self.reserved_dollars_per_hour >= 0, "fleet.reserved_dollars_per_hour", "must be >= 0")
        _check(self.instance_dollars_per_hour > 0, "fleet.instance_dollars_per_hour", "must be > 0")
        _check(0 <= self.hysteresis < 1, "fleet.hysteresis", "must be in [0, 1)")
        _check(self.min_tokens_per_s >= 0, "fleet.min_tokens_per_s", "must be >= 0")
        _check(self.max_dollars_per_hour >= 0, "fleet.max_dollars_per_hour", "must be >= 0 (0 = none)")
        _check(not self.max_dollars_per_hour or self.max_dollars_per_hour >= self.reserved_dollars_per_hour,
               "fleet.max_dollars_per_hour", "is below the reserved cluster's own $/h")


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    run: RunSettings = msgspec.field(default_factory=RunSettings)
    trainer: TrainerSettings = msgspec.field(default_factory=TrainerSettings)
    algorithm: AlgorithmSettings = msgspec.field(default_factory=AlgorithmSettings)
    rollout: RolloutSettings = msgspec.field(default_factory=RolloutSettings)
    services: ServicesSettings = msgspec.field(default_factory=ServicesSettings)
    worker: WorkerSettings = msgspec.field(default_factory=WorkerSettings)
    metrics: MetricsSettings = msgspec.field(default_factory=MetricsSettings)
    data: DataSettings = msgspec.field(default_factory=DataSettings)
    weights: WeightsSettings = msgspec.field(default_factory=WeightsSettings)
    env: EnvSettings = msgspec.field(default_factory=EnvSettings)
    endpoint: EndpointSettings = msgspec.field(default_factory=EndpointSettings)
    harness: HarnessSettings = msgspec.field(default_factory=HarnessSettings)
    fleet: FleetSettings = msgspec.field(default_factory=FleetSettings)
    log_json: bool = False
    log_level: str = "info"


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        # msgspec turns a ValueError of __post_init__ into a ValidationError: ConfigError names the key
        raise ValueError(f"{key}: {why}")


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


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`--trainer.lr 1e-5`, `--trainer.lr=1e-5` or `trainer.lr=1e-5` -> {"trainer": {"lr": "1e-5"}}.

    Values stay strings (TOML-parsed when they look like TOML: lists, booleans, numbers) and
    are converted and validated with the rest of the tree."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--") and "=" not in a:
            if i + 1 >= len(args):
                raise ConfigError(f"override {a} has no value")
            key, value, i = a[2:], args[i + 1], i + 2
        elif "=" in a:
            key, _, value = a.removeprefix("--").partition("=")
            i += 1
        else:
            raise ConfigError(f"override {a!r}: use section.key=value or --section.key value")
        parts = key.replace("-", "_").split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"override {key!r}: use section.key (e.g. trainer.lr)")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _literal(value)
    return out


def _literal(value: str) -> Any:
    """A TOML literal if the value is one (3, 1e-5, true, ["a", "b"]), else the string itself."""
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def load_settings(path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None,
                  overrides: dict[str, Any] | None = None) -> Settings:
    """Defaults < TOML file (explicit path, else $RLBOOST_CONFIG) < environment < overrides."""
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
    _merge(data, overrides or {})
    try:
        # strict=False lets environment strings become ints, floats and booleans.
        return msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid setting: {e}") from None


def apply_overrides(s: Settings, overrides: dict[str, Any]) -> Settings:
    """`s` with `overrides` (nested dict, e.g. from `parse_overrides`) merged in and validated."""
    if not overrides:
        return s
    data = _merge(msgspec.to_builtins(s), overrides)
    try:
        return msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid setting: {e}") from None


_SECRET = ("password", "nkey_seed")


def dump_toml(s: Settings) -> str:
    """The effective settings as TOML (secrets blanked: they come from the environment again)."""
    lines: list[str] = []

    def section(prefix: str, data: dict[str, Any]) -> None:
        scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
        if prefix:
            lines.append(f"[{prefix}]")
        for k, v in scalars.items():
            if v is None:  # TOML has no null: left out, the key's default (None) comes back on load
                continue
            if any(x in k for x in _SECRET):
                v = ""
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
        for k, v in data.items():
            if isinstance(v, dict):
                section(f"{prefix}.{k}" if prefix else k, v)

    section("", msgspec.to_builtins(s))
    return "\n".join(lines).lstrip("\n")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if v == v and v not in (float("inf"), float("-inf")) else ("inf" if v > 0 else "nan")
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {type(v).__name__}")
