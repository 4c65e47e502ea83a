"""Open the NATS, JetStream and checkpoint-store clients a process needs, in one place."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from rlboost import bus, wire
from rlboost.checkpoint import CheckpointStore
from rlboost.config import Settings


@dataclass
class Clients:
    nc: NATS
    js: JetStreamContext
    store: CheckpointStore


@asynccontextmanager
async def open_clients(nats_url: str, redis_url: str, name: str, settings: Settings | None = None,
                       pools: tuple[str, ...] = (), wait_provisioned: bool = False,
                       nats_options: dict | None = None,
                       guard: Callable[[JetStreamContext], AbstractAsyncContextManager] | None = None,
                       ) -> AsyncIterator[Clients]:
    """Connect, provision (idempotent), and close everything on the way out. `wait_provisioned`:
    an identity that may not provision (a worker) waits for the trainer to do it (`bus.provision_or_wait`).
    `nats_options`: more options of the NATS connection (nats-py's `connect`). `guard`: entered
    once connected, before provisioning, and left before closing: the run lease
    (`rlboost.runlease.hold`), so a run refused its servers changes nothing on them."""
    nc = await bus.connect(nats_url, name=name, services=settings.services if settings else None,
                           **(nats_options or {}))
    retention = settings.services.retention if settings else None
    store = CheckpointStore(redis_url, keep_s=retention.checkpoints_s) if retention else CheckpointStore(redis_url)
    try:
        try:
            await store.ping()
        except Exception as e:
            raise ConnectionError(f"cannot reach Redis: {e}") from e
        await store.load_scripts()  # the trainer's identity may; a worker's may not (and need not)
        js = nc.jetstream()
        w = settings.worker if settings else None
        spec = wire.ConsumerSpec(ack_wait_s=w.ack_wait_s, max_deliver=w.max_deliver) if w else wire.ConsumerSpec()
        replicas = settings.services.nats_replicas if settings else 1
        async with guard(js) if guard is not None else contextlib.nullcontext():
            if wait_provisioned:  # not the provisioner: the streams keep the ages the trainer gave them
                await bus.provision_or_wait(js, pools=pools, consumer=spec, replicas=replicas)
            else:
                await bus.provision(js, pools=pools, consumer=spec, replicas=replicas,
                                    ages=retention.stream_ages() if retention else None)
            yield Clients(nc=nc, js=js, store=store)
    finally:
        await store.close()
        if nc.is_connected:
            try:
                await nc.drain()
            except Exception:  # a pull request still parked on the server: just close
                await nc.close()
