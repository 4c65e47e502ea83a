"""How rlboost's HTTP servers run: an aiohttp application on one bound address.

Both servers (`rlboost serve-openai`, rlboost/endpoint/; the weight peers, rlboost/weights/peerhttp.py)
are aiohttp applications; this module binds one, says where it listens, and holds the rule they
share: an address other than loopback is served only behind a token.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from aiohttp import web

__all__ = ["loopback", "start_app"]


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def start_app(app: web.Application, host: str, port: int, *, shutdown_timeout: float,
                    **handler_args: Any) -> tuple[web.AppRunner, tuple[str, int]]:
    """Serve `app` on host:port (0: a free port); the runner (`await runner.cleanup()` stops it)
    and the bound address. No access log: each server logs what it did itself. On cleanup a
    request still running gets `shutdown_timeout` seconds, then is cancelled."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=shutdown_timeout,
                           **handler_args)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, (bound_host, bound_port)
