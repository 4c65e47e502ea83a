"""The endpoint's HTTP: an aiohttp application serving the OpenAI routes (and rlboost's reward
route) over the chat application (chat.py), and `OpenAIEndpoint`, which binds it and follows
the results.

Routes: `GET /health`, `GET /v1/models`, `POST /v1/chat/completions`,
`POST /v1/rlboost/sessions/{id}/reward`. Everything under /v1 needs the bearer token when one is
set (checked before the route, so an unauthenticated client learns nothing). Bodies are bounded
(`endpoint.max_body_bytes`, refused 413 before they are read when their length says so), as are
the calls waiting at once (`endpoint.max_inflight`, 429), the open connections (503) and idle
keep-alive connections; nothing a client sends can end the server: every failure of a route is
answered as an OpenAI error object (HTTP that does not parse is aiohttp's own 400).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from pathlib import Path

from aiohttp import web

from rlboost import metrics, wire
from rlboost.clients import Clients
from rlboost.config import EndpointSettings
from rlboost.endpoint import parse, stream
from rlboost.endpoint.bridge import Binding, Dataflow
from rlboost.endpoint.chat import Chats
from rlboost.endpoint.errors import EndpointError, bad
from rlboost.endpoint.sessions import SessionBook
from rlboost.envs.chat import ChatFormat, chat_format
from rlboost.logs import get_logger
from rlboost.webserver import loopback, start_app

IDLE_TIMEOUT_S = 120.0  # a keep-alive connection with nothing to say for this long is closed (and a body this slow)
MAX_CONNECTIONS = 1024  # open HTTP connections; a client past it is answered 503
CHAT_ROUTE = "/v1/chat/completions"
PINNED = web.RequestKey("rlboost_session", str)  # a request made with a bound session's key: that session


def _json(status: int, payload: dict, close: bool = False) -> web.Response:
    resp = web.Response(status=status, content_type="application/json",
                        body=json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode())
    if close:
        resp.force_close()
    return resp


class OpenAIEndpoint:
    """The server. `start()` binds and begins following results; `close()` stops both."""

    def __init__(self, clients: Clients, cfg: EndpointSettings, tokenizer, stop_ids: list[int], run_dir: str | Path,
                 *, token: str = "", max_context: int = 0, fmt: ChatFormat | None = None,
                 bindable: bool = False) -> None:
        """`bindable`: a training run's endpoint (`bind`): it follows the results of every step."""
        self.cfg, self.token = cfg, token
        self.run_dir = Path(run_dir)
        self.run_id = wire.new_run_id()  # request ids of this life never collide with an earlier one's
        self.log = get_logger(component="endpoint", run_id=self.run_id, pool=cfg.pool)
        self.dataflow = Dataflow(clients, cfg, self.run_id, self.log, all_steps=bindable)
        self.fmt = fmt or chat_format(tokenizer)
        self.chats = Chats(cfg, tokenizer, self.fmt, stop_ids, max_context, self.dataflow, SessionBook(self.run_dir),
                           self.run_dir, self.log)
        self._runner: web.AppRunner | None = None
        self.address: tuple[str, int] = ("", 0)
        self._keys: dict[str, str] = {}  # a bound session's API key -> the session

    def bind(self, session: str, *, step: int, group: int, version: int, run: str) -> Binding:
        """A session for one harness process of a training run: its calls become requests of
        step `step`, group `group`, under `version` (bridge.Binding). Its key (`Binding.key`, the
        process's OPENAI_API_KEY) is accepted like the endpoint's token, and pins every call made
        with it to this session: the process needs no session header, and cannot speak for
        (or report the reward of) another session."""
        if not self.dataflow.all_steps:
            raise EndpointError("this endpoint follows its own step's results only: make it with bindable=True")
        parse.check_session(session)
        b = Binding(session=session, step=step, group=group, version=version, run=wire.check_name("run", run),
                    key="rb-" + secrets.token_urlsafe(24))
        self.chats.bindings[session] = b
        self._keys[b.key] = session
        return b

    def unbind(self, session: str) -> None:
        b = self.chats.bindings.pop(session, None)
        if b is not None:
            self._keys.pop(b.key, None)

    async def start(self) -> tuple[str, int]:
        if not self.token and not loopback(self.cfg.host):
            raise EndpointError(f"endpoint.host {self.cfg.host!r} is not a loopback address: set a token in "
                                f"${self.cfg.token_env} first (an open endpoint spends the pool's GPUs)")
        await self.dataflow.start()
        # a call still waiting at close is cancelled, unanswered: its harness retries it (with its
        # Idempotency-Key, on the next life, the turn comes from its checkpoint)
        self._runner, self.address = await start_app(
            self._app(), self.cfg.host, self.cfg.port, shutdown_timeout=0.5, keepalive_timeout=IDLE_TIMEOUT_S)
        self.log.info("serving", host=self.address[0], port=self.address[1], step=self.dataflow.step,
                      run_dir=str(self.run_dir), auth=bool(self.token), chat_format=getattr(self.fmt, "name", "?"))
        return self.address

    async def close(self) -> None:
        await self.dataflow.close()  # first: no call waiting now can be answered, nor recorded
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------ the application

    def _app(self) -> web.Application:
        # the body limit is enforced in `_body` (an OpenAI error, not aiohttp's text); this one
        # only keeps aiohttp from refusing first
        app = web.Application(middlewares=[self._errors, self._guard], client_max_size=self.cfg.max_body_bytes + 1)
        app.router.add_route("*", "/health", self._health)
        app.router.add_get("/v1/models", self._models, allow_head=False)
        app.router.add_post(CHAT_ROUTE, self._chat)
        app.router.add_post("/v1/rlboost/sessions/{session}/reward", self._reward)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return _json(200, {"ok": True, "inflight": self.chats.inflight})

    async def _models(self, request: web.Request) -> web.Response:
        return _json(200, {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model", "created": 0,
                                                       "owned_by": "rlboost"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        headers = {k.lower(): v for k, v in request.headers.items()}
        if (pinned := request.get(PINNED)) is not None:  # a bound session's key names its session
            named = next((headers[h] for h in parse.SESSION_HEADERS if h in headers), pinned)
            if named != pinned:
                raise EndpointError(f"this API key is session {pinned!r}'s; it cannot call as {named[:64]!r}", 403,
                                    kind="permission_error")
            headers["x-session-id"] = pinned
        prepared = self.chats.prepare(await self._body(request), headers)  # a bad call: its HTTP error
        if not prepared.call.stream:
            return _json(200, await self.chats.answer(prepared))
        return await self._stream(request, prepared)

    async def _stream(self, request: web.Request, prepared) -> web.StreamResponse:
        """`stream: true` (stream.py): SSE comments while the turn is generated, then the recorded
        answer as chunks and `[DONE]`; a failure once the stream started is an error event."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)
        answering = asyncio.create_task(self.chats.answer(prepared))
        try:
            while not (await asyncio.wait({answering}, timeout=stream.KEEPALIVE_S))[0]:
                await resp.write(stream.KEEPALIVE)
            try:
                whole = answering.result()
            except EndpointError as e:
                self.log.warning("streamed call failed", status=e.status, error=str(e))
                await resp.write(stream.event(e.body()))
                return resp
            except Exception as e:  # a bug or a server fault: this call fails, the server serves on
                self.log.error("streamed call failed", error=f"{type(e).__name__}: {e}")
                await resp.write(stream.event(EndpointError(f"internal error: {type(e).__name__}: {e}", 500,
                                                            kind="server_error").body()))
                return resp
            for chunk in stream.chunks(whole, prepared.call.include_usage):
                await resp.write(stream.event(chunk))
            await resp.write(stream.DONE)
            await resp.write_eof()
        except ConnectionError:  # the harness hung up: its call still finishes and is recorded
            self.log.info("streamed call's client went away", session=prepared.session)
            await asyncio.wait({answering})
        except asyncio.CancelledError:  # the server closes: as a non-streamed call, unanswered
            answering.cancel()
            raise
        return resp

    async def _reward(self, request: web.Request) -> web.Response:
        session = request.match_info["session"]
        if (pinned := request.get(PINNED)) is not None and session != pinned:
            raise EndpointError(f"this API key is session {pinned!r}'s; it cannot report {session[:64]!r}'s reward",
                                403, kind="permission_error")
        return _json(200, await self.chats.reward(session, await self._body(request)))

    async def _body(self, request: web.Request):
        """The request's JSON (None when empty), read within `max_body_bytes` and `IDLE_TIMEOUT_S`."""
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise EndpointError(f"the body is {request.content_length} bytes, over endpoint.max_body_bytes ({limit})", 413)
        try:
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise EndpointError(f"the body is over endpoint.max_body_bytes ({limit})", 413) from None
        except TimeoutError:
            raise EndpointError(f"the body did not arrive within {IDLE_TIMEOUT_S:g} s", 408) from None
        if len(body) > limit:
            raise EndpointError(f"the body is over endpoint.max_body_bytes ({limit})", 413)
        try:
            return json.loads(body) if body else None
        except ValueError as e:
            raise bad(f"the request body is not JSON ({e})") from None
        except RecursionError:
            raise bad("the request body is nested too deeply") from None

    # ------------------------------------------------------------ what wraps every route

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """The connection bound, then the token on everything under /v1, before the route."""
        if self._runner is not None and self._runner.server is not None \
                and len(self._runner.server.connections) > MAX_CONNECTIONS:
            raise EndpointError(f"over {MAX_CONNECTIONS} open connections; retry later", 503,
                                kind="service_unavailable")
        if request.path == "/health":
            return await handler(request)
        if not request.path.startswith("/v1/"):
            raise EndpointError(f"no route {request.path}: this is an OpenAI-compatible API under /v1", 404,
                                kind="not_found_error")
        if self.token or self._keys:
            scheme, _, value = request.headers.get("authorization", "").partition(" ")
            value = value.strip() if scheme.lower() == "bearer" else ""
            # a session key is looked up by value (a dict), then compared in constant time too
            pinned = self._keys.get(value)
            if pinned is not None and hmac.compare_digest(value.encode(), self.chats.bindings[pinned].key.encode()):
                request[PINNED] = pinned
            elif not (self.token and value and hmac.compare_digest(value.encode(), self.token.encode())):
                raise EndpointError("missing or wrong bearer token (Authorization: Bearer <token>)", 401,
                                    kind="authentication_error")
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every failure as an OpenAI error object (the connection closed after a 408, 413 or 503),
        and the chat route's calls counted by status."""
        t0 = time.monotonic()
        try:
            resp = await handler(request)
        except web.HTTPMethodNotAllowed as e:
            resp = _json(405, EndpointError(f"use {' or '.join(sorted(e.allowed_methods))} {request.path}", 405).body())
        except web.HTTPNotFound:
            resp = _json(404, EndpointError(f"no route {request.path}", 404, kind="not_found_error").body())
        except EndpointError as e:
            if e.status >= 500:
                self.log.warning("call failed", status=e.status, error=str(e))
            resp = _json(e.status, e.body(), close=e.status in (408, 413, 503))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:  # a bug or a server fault: this call fails, the server serves on
            self.log.error("call failed", error=f"{type(e).__name__}: {e}", target=request.path_qs[:200])
            resp = _json(500, EndpointError(f"internal error: {type(e).__name__}: {e}", 500, kind="server_error").body())
        if request.path == CHAT_ROUTE:
            metrics.ENDPOINT_CALLS.labels(str(resp.status)).inc()
            if resp.status == 200:
                metrics.ENDPOINT_CALL_SECONDS.observe(time.monotonic() - t0)
        return resp
