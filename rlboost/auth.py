"""Who may do what on the wire: per-role NATS permissions and Redis ACLs, generated from Settings.

Three roles (`services.auth` in rlboost/config.py):

- **trainer** (the trainer and the manager): everything. It provisions streams, consumers and
  buckets, publishes fresh requests and policy versions, reads results.
- **worker** (rollout workers on preemptible capacity): exactly what `workers/worker.py` needs
  and nothing more. It may pull from its pools' two consumers and ack, publish token chunks,
  results, lease events, dead letters and hand-offs (its pools' resume lanes only), put its
  heartbeat in `rb-workers`, read `rb-policy`, `rb-control` and the weights object store. It may
  not publish fresh requests, touch stream or consumer configurations (create/update/delete/
  purge: no `max_deliver = 1`), delete messages by sequence (the trainer's manager moves poison
  messages), put to `rb-policy`/`rb-control` or write weights. In Redis it reads checkpoint keys
  and runs the checkpoint scripts by EVALSHA (the trainer loads them); no EVAL/SCRIPT, DEL,
  KEYS/SCAN. What it can still do, and why the trainer does not trust it: docs/guides/security.md.
  It may send episodes to its pools' environment lanes (`env.inline = false`), never take from one.
- **env** (environment workers, `workers/env_worker.py`, CPU machines that run episodes' tool
  calls): the environment lane's one consumer (`rb-env`: info, pull, ack), its pools' resume
  lanes (where an episode goes back), token chunks, lease events, dead letters and error
  results; in Redis the commands of the checkpoint scripts it runs (claim, put_episode,
  append_env, release, renew, finish): the worker's, less EXPIRE and PEXPIRE. Nothing else: no fresh lane and no environment lane (it
  takes episodes, it does not inject them), no registry heartbeat, no `rb-policy`/`rb-control`,
  no weights (it runs no model), no stream or consumer configuration, no KV or object writes.

A role is on when it has a password or a public nkey; the role's password is also its Redis ACL
password (one secret per role). Nothing here holds a secret: passwords come from the settings
(TOML or RLBOOST_* env), and `render_*(..., env_refs=True)` writes environment references
instead, which is how `infra/` stays free of secrets and in step with the embedded mode:

    python -m rlboost.auth nats-conf --env-refs > infra/nats/nats.conf
    python -m rlboost.auth redis-start --env-refs > infra/redis/start-redis.sh

(tests/test_infra.py fails when the committed files differ from what this module generates.)

Workers only need their pools' consumers to exist: provisioning (stream create/update) is the
trainer's job, so a worker identity must not run `bus.provision()` against a fresh server.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
from typing import Any

from rlboost import wire
from rlboost.config import AuthSettings, ServicesSettings, load_settings

# Environment variables the servers read the role passwords from (env_refs mode): the settings'
# own RLBOOST_* names, so one `.env` / Kubernetes Secret feeds servers and clients alike.
ENV_TRAINER_PASSWORD = "RLBOOST_SERVICES__AUTH__TRAINER_PASSWORD"
ENV_WORKER_PASSWORD = "RLBOOST_SERVICES__AUTH__WORKER_PASSWORD"
ENV_ENV_PASSWORD = "RLBOOST_SERVICES__AUTH__ENV_PASSWORD"  # the env role's (environment workers')

# Streams a worker reads through ephemeral consumers / direct gets, never writes.
READ_ONLY_STREAMS = (f"KV_{wire.BUCKET_POLICY}", f"KV_{wire.BUCKET_CONTROL}", f"OBJ_{wire.BUCKET_WEIGHTS}")


def roles_configured(auth: AuthSettings) -> bool:
    return bool(auth.trainer_password or auth.trainer_nkey or auth.worker_password or auth.worker_nkey
                or auth.env_password or auth.env_nkey)


def worker_pools(auth: AuthSettings) -> list[str]:
    pools = [p.strip() for p in auth.worker_pools.split(",") if p.strip()]
    for p in pools:
        if p != "*":
            wire.check_name("pool", p)
    return pools or ["*"]


def trainer_permissions() -> dict[str, Any]:
    return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}


def worker_permissions(pools: list[str] | tuple[str, ...] = ("*",)) -> dict[str, Any]:
    """NATS publish/subscribe allow and deny lists of the worker role. `pools` narrows the
    consumers and the resume lane to those pools (`*` = any pool).

    NATS wildcards are whole tokens: `rb-workers-*` would be a literal consumer name that
    matches nothing, so "any pool" is the token wildcard `*` in the consumer position (every
    consumer on the requests stream is a pool consumer). The worker may use its pools'
    consumers (info, pull, ack) but never create, update or delete one (that would let it set
    `max_deliver` to 1), nor delete a stream message by sequence: the trainer provisions the
    consumers and moves poison messages (rlboost/pool_client.py).

    It sends episodes to its pools' environment lanes (`env.inline = false`) but never serves
    one: the environment lane's consumer is the env role's (it may only look it up, as
    `bus.provision` does), refused here even where `*` would cover it."""
    rq = wire.STREAM_REQUESTS
    allow = [
        "rb.tok.>", "rb.res.>", "rb.evt.>", "rb.dlq.>",  # token chunks, results, lease events, DLQ
        f"$KV.{wire.BUCKET_WORKERS}.>",  # own heartbeat in the registry
        f"$KV.{wire.BUCKET_PEERS}.>",  # the weight blobs it serves to its peers, its origin claims
        "$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.INFO.*",  # look-ups, read only
        "$JS.FC.>",  # flow-control replies of ordered consumers (KV watch)
        # the environment lane's consumer: looked up (read only) by `bus.provision(pools=...)`
        f"$JS.API.CONSUMER.INFO.{rq}.{wire.ENV_CONSUMER}",
    ]
    for pool in pools:
        durables = (wire.consumer_name(pool), wire.resume_consumer_name(pool)) if pool != "*" else ("*",)
        allow.append(wire.resume_subject(pool))  # hand-offs: the resume lane only (`rb.req.*.resume`)
        allow.append(wire.env_subject(pool))  # episodes to their tools (`rb.req.*.env`)
        for durable in durables:
            allow += [
                f"$JS.API.CONSUMER.INFO.{rq}.{durable}",
                f"$JS.API.CONSUMER.MSG.NEXT.{rq}.{durable}",
                f"$JS.ACK.{rq}.{durable}.>",  # ack / nak / in-progress / term
            ]
    for stream in (*READ_ONLY_STREAMS, f"KV_{wire.BUCKET_PEERS}"):  # the peers bucket: read here, written above
        allow += [
            f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.API.CONSUMER.DELETE.{stream}.>",
        ]
    env = wire.ENV_CONSUMER  # the env role's: no generation worker pulls from or acks on it
    deny = _rollout_deny() + [
        f"$JS.API.CONSUMER.MSG.NEXT.{rq}.{env}", f"$JS.ACK.{rq}.{env}.>",
        f"$KV.{wire.BUCKET_POLICY}.>", f"$KV.{wire.BUCKET_CONTROL}.>", f"$O.{wire.BUCKET_WEIGHTS}.>",
    ]
    return {
        "publish": {"allow": _dedup(allow), "deny": deny},
        # replies (JetStream API, pulls, KV/object reads); no advisories: poison is the trainer's
        "subscribe": {"allow": ["_INBOX.>"]},
    }


def env_permissions(pools: list[str] | tuple[str, ...] = ("*",)) -> dict[str, Any]:
    """NATS publish/subscribe allow and deny lists of the env role (`rlboost env-worker`).

    Exactly what workers/env_worker.py does: look the streams and the `rb-env` consumer up
    (`bus.provision_or_wait`, `bus.join_pool`: reads only), pull from `rb-env` and ack / nak /
    extend, publish token chunks of the environment's tokens, lease events, dead letters and
    `error` results, and send each episode back to its pool's resume lane (`pools` narrows
    those; `*` = any). The environment lane serves every pool through one consumer, so an
    episode of a pool not in `pools` could be taken but not sent back: list them all.

    Refused besides the generation worker's refusals (`_rollout_deny`): the environment lane
    itself (only a generation worker hands an episode to its tools), every KV and object-store
    write (no heartbeat: the trainer counts generation workers), and, by not being allowed,
    any other consumer, any KV or object-store read (no policy pointer, no weights)."""
    rq, env = wire.STREAM_REQUESTS, wire.ENV_CONSUMER
    allow = [
        "rb.tok.>", "rb.res.>", "rb.evt.>", "rb.dlq.>",  # env tokens, error results, lease events, DLQ
        "$JS.API.INFO", "$JS.API.STREAM.INFO.*",  # look-ups, read only (waiting for the trainer to provision)
        f"$JS.API.CONSUMER.INFO.{rq}.{env}",
        f"$JS.API.CONSUMER.MSG.NEXT.{rq}.{env}",
        f"$JS.ACK.{rq}.{env}.>",  # ack / nak / in-progress (long tool calls) / term
    ]
    allow += [wire.resume_subject(pool) for pool in pools]  # the episode back to its generation workers
    deny = _rollout_deny() + [
        wire.env_subject("*"),  # the environment lane: generation workers hand episodes to it
        "$KV.>", "$O.>",  # no KV or object-store writes at all (registry, policy, control, weights)
    ]
    return {
        "publish": {"allow": _dedup(allow), "deny": deny},
        "subscribe": {"allow": ["_INBOX.>"]},  # replies of the JetStream API and of its pulls
    }


def _rollout_deny() -> list[str]:
    """Refused to both rollout roles (worker, env), whatever their allow lists say: the fresh
    lane, any stream configuration, deleting messages by sequence, (re)configuring a consumer
    on the requests stream (that would let it set `max_deliver` to 1)."""
    rq = wire.STREAM_REQUESTS
    return [
        "rb.req.*",  # the fresh lane: only the trainer/manager injects prompts
        "$JS.API.STREAM.CREATE.>", "$JS.API.STREAM.UPDATE.>", "$JS.API.STREAM.DELETE.>",
        "$JS.API.STREAM.PURGE.>", "$JS.API.STREAM.RESTORE.>", "$JS.API.ACCOUNT.>",
        "$JS.API.STREAM.MSG.DELETE.>",  # deleting queued requests by sequence
        f"$JS.API.CONSUMER.CREATE.{rq}", f"$JS.API.CONSUMER.CREATE.{rq}.>",  # (re)configuring the pool consumers
        f"$JS.API.CONSUMER.DURABLE.CREATE.{rq}.>", f"$JS.API.CONSUMER.DELETE.{rq}.>",
    ]


def _dedup(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


# ---------------------------------------------------------------- nats-server config


def _q(s: str) -> str:
    """A quoted NATS config string (JSON escaping is what the config lexer accepts)."""
    return json.dumps(s)


def _credential(password: str, nkey: str, env_name: str, env_refs: bool) -> str:
    if nkey:
        return f"nkey: {_q(nkey)}"
    return f"password: ${env_name}" if env_refs else f"password: {_q(password)}"


def _perm_block(perms: dict[str, Any], indent: str) -> str:
    lines = [f"{indent}permissions: {{"]
    for direction in ("publish", "subscribe"):
        lines.append(f"{indent}  {direction}: {{")
        for kind in ("allow", "deny"):
            subjects = perms[direction].get(kind) or []
            if subjects:
                lines.append(f"{indent}    {kind}: [")
                lines += [f"{indent}      {_q(s)}" for s in subjects]
                lines.append(f"{indent}    ]")
        lines.append(f"{indent}  }}")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


def render_nats_conf(services: ServicesSettings, *, env_refs: bool = False, listen: str = "",
                     monitor_port: int = 0, store_dir: str = "") -> str:
    """A nats-server config with one user per configured role and its permissions.

    `env_refs`: passwords as `$RLBOOST_SERVICES__AUTH__*_PASSWORD` references that nats-server
    resolves from its environment (infra/); else the literal passwords (embedded `rlboost up`,
    written 0600 into the data dir). `listen`/`monitor_port`/`store_dir` are left to the command
    line when empty (the embedded mode passes -a/-p/-sd)."""
    a = services.auth
    if not (roles_configured(a) or env_refs):
        raise ValueError("no roles configured: set services.auth.trainer_password / worker_password / env_password "
                         "(or nkeys)")
    out = ["# Generated by rlboost.auth: per-role users and permissions. Do not edit by hand."]
    if listen:
        out.append(f"listen: {_q(listen)}")
    if monitor_port:
        out.append(f"http_port: {monitor_port}")
    if store_dir:
        out += ["jetstream {", f"  store_dir: {_q(store_dir)}", "}"]
    if a.tls_cert:
        out += ["tls {", f"  cert_file: {_q(a.tls_cert)}", f"  key_file: {_q(a.tls_key)}"]
        if a.tls_ca:
            out += [f"  ca_file: {_q(a.tls_ca)}", "  verify: true"]
        out.append("}")
    users: list[str] = []
    roles = (
        (a.trainer_user, a.trainer_password, a.trainer_nkey, ENV_TRAINER_PASSWORD, trainer_permissions()),
        (a.worker_user, a.worker_password, a.worker_nkey, ENV_WORKER_PASSWORD, worker_permissions(worker_pools(a))),
        (a.env_user, a.env_password, a.env_nkey, ENV_ENV_PASSWORD, env_permissions(worker_pools(a))),
    )
    for user, password, nkey, env_name, perms in roles:
        if not (password or nkey or env_refs):
            continue
        head = [f"    {_credential(password, nkey, env_name, env_refs)}"]
        if not nkey:
            head.insert(0, f"    user: {_q(user)}")
        users.append("  {\n" + "\n".join(head) + "\n" + _perm_block(perms, "    ") + "\n  }")
    out += ["authorization {", "  users: [", ",\n".join(users), "  ]", "}"]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- Redis ACL

# The worker touches only checkpoint keys (`rb:{rid}:*`, rlboost/wire/names.py) through
# rlboost/checkpoint.py: a few reads, and the fencing Lua scripts by EVALSHA. Lua runs with the
# caller's permissions, so the write commands those scripts call are granted too; everything
# else is not: no EVAL or SCRIPT (the trainer loads the project's scripts, `load_scripts`), no
# DEL/UNLINK/FLUSH*/RENAME, no KEYS/SCAN/RANDOMKEY (key names are not listed), no CONFIG/DEBUG.
# Value sizes are bounded by the server (`REDIS_MAX_VALUE`). Redis cannot tell a script's command
# from the same command sent directly, so these commands are the role's on any `rb:` key: what
# that still allows, and why the trainer does not trust it, is in docs/guides/security.md.
_REDIS_READS = ("ping", "hello", "auth", "echo", "select",  # connection
                "get", "hget", "hmget", "lrange",  # reads of rlboost/checkpoint.py
                "evalsha")  # the checkpoint scripts, loaded by the trainer
WORKER_REDIS_COMMANDS = (
    *_REDIS_READS,
    # called by those scripts (with the worker's permissions):
    "hset", "set", "rpush", "expire", "pexpire", "pttl", "strlen", "append",
    "time",  # the claim's epoch clock (fencing that survives a store restart)
)
WORKER_REDIS_RULES = "resetkeys ~rb:* resetchannels -@all " + " ".join(f"+{c}" for c in WORKER_REDIS_COMMANDS)
# An environment worker runs the scripts of an episode's tool phase (claim with `inherit`,
# put_episode, append_env, renew, release, finish) with its own permissions. None of them calls
# EXPIRE or PEXPIRE (rlboost/checkpoint.py says how), so the env role has neither: it cannot
# shorten the life of a finished checkpoint (or of any key) to erase it.
ENV_REDIS_COMMANDS = (*_REDIS_READS, "hset", "set", "rpush", "pttl", "strlen", "append", "time")
ENV_REDIS_RULES = "resetkeys ~rb:* resetchannels -@all " + " ".join(f"+{c}" for c in ENV_REDIS_COMMANDS)
TRAINER_REDIS_RULES = "~* &* +@all"
REDIS_MAX_VALUE = "8mb"  # proto-max-bulk-len: no client writes a bigger value (a checkpoint: 1M tokens)


def render_redis_acl(auth: AuthSettings, *, env_refs: bool = False) -> str:
    """ACL file lines: the `default` user off, one user per role with a password."""
    lines = ["user default off"]
    for user, password, env_name, rules in (
        (auth.trainer_user, auth.trainer_password, ENV_TRAINER_PASSWORD, TRAINER_REDIS_RULES),
        (auth.worker_user, auth.worker_password, ENV_WORKER_PASSWORD, WORKER_REDIS_RULES),
        (auth.env_user, auth.env_password, ENV_ENV_PASSWORD, ENV_REDIS_RULES),
    ):
        if env_refs:
            lines.append(f"user {user} on >${{{env_name}}} {rules}")
        elif password:
            if any(c.isspace() for c in password):
                raise ValueError(f"Redis ACL password of {user} must not contain whitespace")
            lines.append(f"user {user} on >{password} {rules}")
    return "\n".join(lines) + "\n"


def render_redis_start(auth: AuthSettings) -> str:
    """infra/redis/start-redis.sh: write the ACL file from the environment, then exec redis."""
    acl = render_redis_acl(auth, env_refs=True)
    return (
        "#!/bin/sh\n"
        "# Generated by rlboost.auth (python -m rlboost.auth redis-start --env-refs). Do not edit by hand.\n"
        "# Writes the per-role Redis ACL from the environment (no secrets in files), then runs redis.\n"
        "set -eu\n"
        f': "${{{ENV_TRAINER_PASSWORD}:?set it (see infra/.env.example)}}"\n'
        f': "${{{ENV_WORKER_PASSWORD}:?set it (see infra/.env.example)}}"\n'
        f': "${{{ENV_ENV_PASSWORD}:?set it (see infra/.env.example)}}"\n'
        "umask 077\n"
        'ACL="${REDIS_ACL_FILE:-/tmp/users.acl}"\n'
        'cat > "$ACL" <<EOF\n'
        f"{acl}"
        "EOF\n"
        f'exec redis-server --aclfile "$ACL" --proto-max-bulk-len {REDIS_MAX_VALUE} "$@"\n'
    )


# ---------------------------------------------------------------- client side


def nats_connect_options(services: ServicesSettings) -> dict[str, Any]:
    """Extra keyword arguments for `bus.connect` (nats-py): nkey seed file and TLS."""
    opts: dict[str, Any] = {}
    if services.nats_nkey_seed:
        opts["nkeys_seed"] = services.nats_nkey_seed
    if services.nats_tls_ca or services.nats_tls_cert:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=services.nats_tls_ca or None)
        if services.nats_tls_cert:
            ctx.load_cert_chain(services.nats_tls_cert, services.nats_tls_key or None)
        opts["tls"] = ctx
    return opts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlboost.auth", description="render server auth configs")
    p.add_argument("what", choices=["nats-conf", "redis-acl", "redis-start"])
    p.add_argument("--env-refs", action="store_true", help="environment references instead of passwords")
    p.add_argument("--config", help="TOML settings file")
    p.add_argument("--listen", default="", help="nats: listen address, e.g. 0.0.0.0:4222")
    p.add_argument("--monitor-port", type=int, default=0, help="nats: monitoring port (health, KEDA)")
    p.add_argument("--store-dir", default="", help="nats: JetStream store dir")
    a = p.parse_args(argv)
    s = load_settings(a.config)
    if a.what == "nats-conf":
        text = render_nats_conf(s.services, env_refs=a.env_refs, listen=a.listen, monitor_port=a.monitor_port,
                                store_dir=a.store_dir)
    elif a.what == "redis-acl":
        text = render_redis_acl(s.services.auth, env_refs=a.env_refs)
    else:
        text = render_redis_start(s.services.auth)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
