"""`rlboost serve-openai`: an OpenAI-compatible chat-completions endpoint backed by the dataflow.

The command: settings and flags, the model's tokenizer, the clients, then the endpoint
(server.py) until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from pathlib import Path

from rlboost.config import Settings
from rlboost.endpoint.errors import EndpointError
from rlboost.endpoint.server import OpenAIEndpoint
from rlboost.webserver import loopback


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost serve-openai", description=__doc__.splitlines()[0])
    p.add_argument("--host", help="address to bind (endpoint.host; loopback by default)")
    p.add_argument("--port", type=int, help="port (endpoint.port; 0 = a free one)")
    p.add_argument("--model-dir", help="the model folder whose tokenizer and chat template are used (endpoint.model_dir)")
    p.add_argument("--model-name", help="the model id /v1/models lists (endpoint.model_name)")
    p.add_argument("--pool", help="the worker pool the calls go to (endpoint.pool)")
    p.add_argument("--run-dir", help="where sessions are recorded (endpoint.run_dir)")
    a = p.parse_args(argv)
    cfg = s.endpoint
    for key in ("host", "port", "model_dir", "model_name", "pool", "run_dir"):
        if getattr(a, key) is not None:
            setattr(cfg, key, getattr(a, key))
    return asyncio.run(serve(s))


async def serve(s: Settings, stop: asyncio.Event | None = None) -> int:
    from rlboost.clients import open_clients
    from rlboost.modeldir import check_model_dir, load_tokenizer, stop_ids
    from rlboost.services import resolve_urls

    cfg = s.endpoint
    token = os.environ.get(cfg.token_env, "") if cfg.token_env else ""
    if not token and not loopback(cfg.host):  # before anything connects or loads
        raise EndpointError(f"endpoint.host {cfg.host!r} is not a loopback address: set a token in "
                            f"${cfg.token_env or 'RLBOOST_ENDPOINT_TOKEN'} first (an open endpoint spends the pool's GPUs)")
    model_dir = cfg.model_dir or s.run.model_dir or str(Path(s.services.data_dir) / "model")
    info = check_model_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    run_dir = Path(cfg.run_dir or Path("runs") / time.strftime("endpoint-%Y%m%d-%H%M%S"))
    nats_url, redis_url = resolve_urls(s.services)
    if s.metrics.port:
        from rlboost.metrics import start_metrics_server

        start_metrics_server(s.metrics.port, s.metrics.bind)
    async with open_clients(nats_url, redis_url, "rlboost-endpoint", settings=s, pools=(cfg.pool,)) as c:
        ep = OpenAIEndpoint(c, cfg, tokenizer, stop_ids(model_dir, tokenizer), run_dir, token=token,
                            max_context=info.max_context)
        host, port = await ep.start()
        print(f"serving an OpenAI-compatible API on http://{host}:{port}/v1 (model {cfg.model_name!r}, pool "
              f"{cfg.pool!r}, {'bearer token from $' + cfg.token_env if token else 'no token: loopback only'}); "
              f"sessions recorded in {run_dir / 'sessions'}", flush=True)
        if stop is None:  # SIGTERM / Ctrl-C: stop serving, close the connections, exit 0
            import signal

            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await ep.close()
    return 0
