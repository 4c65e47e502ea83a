"""`rlboost replay`: the life of one request, or a summary of a step, read back from the streams.

Everything a request went through is on the wire: its lease events (RB_EVENTS: published,
claimed, released on a drain, fenced after a takeover, finished), its token chunks as they were
checkpointed (RB_TOKENS: one `TokenFlush` per worker flush, which carries the chunks of every
request of that flush), and its result (RB_RESULTS). Replay reads them with ordered consumers
filtered to the request's subjects (the step's token flushes, for its chunks) and prints a
timeline.

An episode's request (schema 4) is shown turn by turn from its result (`episode_turns`): each
model turn with the workers, policy versions and weights digests that generated its tokens (a
turn handed off mid-way has several), each environment turn with its tool calls (tool, idempotency
key, who ran it, latency, result size: the `ToolRecord`s of the final episode state) and the
environment tokens it appended, the lease events (claims, hand-offs, fencing) at the turn where
they happened, and the reward. The reward is the trainer's to compute and is not on the
streams: replay computes it the trainer's way (`EpisodeRunner.finish`) when it can load the
environment (`--env`, else the settings' `[env] ref` with `[env.options]`). An episode without
a result yet is shown from the checkpoint store (`running_episode`): its turns so far, a model
turn under way, the tool calls pending. Each model turn's text is decoded with the run's
tokenizer (`--model-dir`, else the model of `--run-dir`'s settings.toml, else the settings'
`run.model_dir`; without one, token counts only), and what the environment got wrong (the
snapshot's `errors`: why an episode ended `env_error`) is listed under the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from rlboost import bus, episodes, wire
from rlboost.config import ConfigError, EnvSettings, ServicesSettings, Settings, load_settings
from rlboost.errors import RlboostError
from rlboost.services import resolve_urls

# what a replay reads: lease events, token flushes, results
READ_STREAMS = (wire.STREAM_EVENTS, wire.STREAM_TOKENS, wire.STREAM_RESULTS)


class ReplayError(RlboostError):
    """Nothing to replay on these servers (one line, says why)."""

_STEP = re.compile(r"(?:^|-)s(\d+)-p\d+-g\d+$")


async def read_subject(js: JetStreamContext, subject: str, kind: type, idle_s: float = 0.5) -> list:
    """All messages on `subject` from the start of its stream, decoded (bad ones skipped); none
    when the stream does not exist (a run that never got that far)."""
    out = []
    try:
        sub = await bus.follow(js, subject)
    except NotFoundError:
        return out
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_s)
            except TimeoutError:
                break
            try:
                out.append(wire.decode(kind, msg.data))
            except wire.WireError:
                continue
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out


async def read_chunks(js: JetStreamContext, step: int, request_id: str | None = None) -> list[wire.TokenChunk]:
    """The token chunks of a step (of one request, if given), out of the step's token flushes."""
    return [c for f in await read_subject(js, wire.token_steps_subject(step), wire.TokenFlush)
            for c in f.token_chunks() if request_id is None or c.request_id == request_id]


@dataclass
class Life:
    request_id: str
    events: list[wire.LeaseEvent] = field(default_factory=list)
    chunks: list[wire.TokenChunk] = field(default_factory=list)
    result: wire.RolloutResult | None = None

    def tokens_by_worker(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for c in self.chunks:
            out[c.worker_id] += len(c.token_ids)
        return dict(out)

    def handoffs(self) -> int:
        return sum(1 for e in self.events if e.kind in ("release", "fenced"))

    def summary(self) -> dict:
        r = self.result
        return {"request_id": self.request_id, "workers": list(self.tokens_by_worker()),
                "tokens_by_worker": self.tokens_by_worker(), "claims": sum(e.kind == "claim" for e in self.events),
                "handoffs": self.handoffs(), "result_tokens": len(r.token_ids) if r else None,
                "finish_reason": r.finish_reason if r else None, "finished": r is not None}


def migrations(events: list[wire.LeaseEvent]) -> list[tuple[wire.LeaseEvent, wire.LeaseEvent]]:
    """(left, claimed) pairs, one per change of hands: each claim by a worker other than the
    request's last holder, with the event that ended that hold — its `release` (a hand-off),
    or its own `claim` when it vanished without one (a kill, or a lease lost)."""
    by_rid: dict[str, list[wire.LeaseEvent]] = defaultdict(list)
    for e in events:
        by_rid[e.request_id].append(e)
    out = []
    for evs in by_rid.values():
        last = None  # the last claim or release
        for e in sorted(evs, key=lambda e: e.ts):
            if e.kind == "claim":
                if last is not None and last.worker_id != e.worker_id:
                    out.append((last, e))
                last = e
            elif e.kind == "release":
                last = e
    return out


async def life_of(js: JetStreamContext, step: int, request_id: str) -> Life:
    life = Life(request_id)
    life.events = sorted(await read_subject(js, wire.event_subject(step, request_id), wire.LeaseEvent), key=lambda e: e.ts)
    life.chunks = sorted(await read_chunks(js, step, request_id), key=lambda c: c.ts)
    results = [r for r in await read_subject(js, wire.result_subject(step), wire.RolloutResult)
               if r.request_id == request_id]
    life.result = results[0] if results else None
    return life


async def step_lives(js: JetStreamContext, step: int) -> dict[str, Life]:
    lives: dict[str, Life] = {}
    for e in await read_subject(js, f"rb.evt.{step}.>", wire.LeaseEvent):
        lives.setdefault(e.request_id, Life(e.request_id)).events.append(e)
    for c in await read_chunks(js, step):
        lives.setdefault(c.request_id, Life(c.request_id)).chunks.append(c)
    for r in await read_subject(js, wire.result_subject(step), wire.RolloutResult):
        lives.setdefault(r.request_id, Life(r.request_id)).result = r
    return lives


def print_timeline(life: Life) -> None:
    rows: list[tuple[float, str]] = []
    for e in life.events:
        what = {"claim": f"claimed by {e.worker_id} (epoch {e.epoch}), resuming at token {e.offset}",
                "release": f"handed off by {e.worker_id} at token {e.offset} ({e.detail})",
                "fenced": f"{e.worker_id} lost the lease (epoch {e.epoch} stale) at token {e.offset}",
                "finish": f"finished by {e.worker_id} with {e.offset} tokens",
                "publish": f"published by {e.worker_id}",
                "deadletter": f"dead-lettered: {e.detail}"}.get(e.kind, e.kind)
        rows.append((e.ts, what))
    for c in life.chunks:
        rows.append((c.ts, f"  tokens {c.offset}..{c.offset + len(c.token_ids) - 1} from {c.worker_id} "
                           f"(policy v{c.policy_version})"))
    if life.result:
        r = life.result
        rows.append((r.ts, f"result: {len(r.token_ids)} tokens, {r.finish_reason}, segments "
                           + ", ".join(f"{s.worker_id}@{s.offset}" for s in r.segments)))
    t0 = min((t for t, _ in rows), default=time.time())
    print(f"request {life.request_id}")
    for t, what in sorted(rows):
        print(f"  +{t - t0:8.3f}s  {what}")
    print(f"  tokens by worker: {life.tokens_by_worker()}; hand-offs: {life.handoffs()}")


# ---------------------------------------------------------------- episodes, turn by turn

_SHOWN = {"claim", "release", "fenced"}  # the lease events shown at the turn where they happened


def _short(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"


def load_tokenizer(model_dir: str) -> tuple[Any, str]:
    """(the tokenizer of `model_dir`, "") or (None, why not: one line)."""
    if not model_dir:
        return None, ("no tokenizer to show the model's text (give --model-dir, or --run-dir: the run's "
                      "settings.toml names its model): token counts only")
    from rlboost.modeldir import load_tokenizer as load

    try:
        return load(model_dir), ""
    except RlboostError as e:
        return None, f"no tokenizer to show the model's text ({e}): token counts only"


def add_text(turns: list[dict], token_ids: list[int], tokenizer: Any) -> None:
    """Each model turn's `text`: its tokens (`token_ids`: the stream after the prompt) decoded,
    special tokens kept (a turn's end token says how it ended)."""
    for t in turns:
        if t["kind"] == "model":
            t["text"] = tokenizer.decode(token_ids[t["start"]:t["end"]], skip_special_tokens=False)


def episode_errors(state: wire.EpisodeState) -> list[str]:
    """What the environment got wrong in this episode, in words (the snapshot's `errors`: an
    `env_error` end says why here)."""
    try:
        return list(episodes.snapshot(state).errors)
    except episodes.EpisodeStateError as e:
        return [f"the episode state is unreadable: {e}"]


def episode_turns(life: Life) -> list[dict] | None:
    """The turns of an episode's result in stream order (None: not an episode's result, or its
    state unreadable). A model turn: its response offsets, tokens, and `parts`: who generated
    which of its tokens (worker, lease epoch, policy version, weights digest), from the result's
    segments; an environment turn: the tool calls it answered (`ToolRecord`: key, tool, the worker
    that ran it, latency, error; the result's size from the transcript) and who appended its
    tokens. Each turn lists the claims / hand-offs / fencings whose offset falls in it."""
    r = life.result
    if r is None or r.episode is None:
        return None
    return turns_of(r.episode, r.segments, len(r.token_ids), life.events)


def turns_of(state: wire.EpisodeState, segments: list[wire.Segment], n: int,
             events: list[wire.LeaseEvent]) -> list[dict] | None:
    """`episode_turns` from an episode state, the segments of its token stream and its length
    (`n` tokens after the prompt): a result's, or a running episode's checkpoint (then tokens
    past the state's `at` are a model turn under way, `"under_way": true`, and the calls of its
    last turn without a result yet are `pending`)."""
    try:
        snap, lengths = episodes.layout(state)
    except episodes.EpisodeStateError:
        return None
    segs = sorted(segments, key=lambda s: s.offset)
    spans = [(s, s.offset, segs[i + 1].offset if i + 1 < len(segs) else n) for i, s in enumerate(segs)]
    results = {m.tool_call_id: m for m in snap.messages if m.role == "tool" and m.tool_call_id}
    args = {c.key: c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments)
            for m in snap.messages if m.role == "assistant" for c in m.tool_calls}
    calls: dict[int, list[wire.ToolRecord]] = defaultdict(list)
    for c in state.calls:
        calls[c.at].append(c)

    def call_row(c: wire.ToolRecord) -> dict:
        res = results.get(c.key)
        return {"key": c.key, "tool": c.name, "arguments": _short(args.get(c.key, "")), "worker": c.worker_id,
                "latency_s": round(c.latency_s, 6), "error": c.error,
                "result_chars": len(res.content) if res else None, "result": _short(res.content) if res else None}

    def who(kind: str, a: int, b: int) -> list[dict]:
        out = []
        for s, lo, hi in spans:
            k = max(0, min(b, hi) - max(a, lo))
            if s.kind == kind and k:
                out.append({"worker": s.worker_id, "epoch": s.epoch, "policy_version": s.policy_version,
                            "weights": s.weights[:12], "tokens": k})
        return out

    turns: list[dict] = []
    pos = -(lengths[0] if snap.segments and snap.segments[0].kind == "prompt" else 0)
    for seg, k in zip(snap.segments, lengths, strict=True):
        a, b = pos, pos + k
        pos = b
        if seg.kind == "prompt":
            continue
        t: dict = {"kind": seg.kind, "turn": seg.turn, "start": a, "end": b, "tokens": k}
        if seg.kind == "model":
            t.update(worker=seg.worker, policy_version=seg.policy_version, weights=seg.weights_digest[:12],
                     parts=who("model", a, b))
        else:
            t.update(calls=[call_row(c) for c in calls.pop(a, [])], appended_by=who("env", a, b))
        turns.append(t)
    for at, left in sorted(calls.items()):  # calls whose reply was never appended (the episode ended there)
        i = next((i for i, t in enumerate(turns) if t["start"] >= at and t["kind"] == "model"), len(turns))
        turn = turns[i - 1]["turn"] if i else 0
        turns.insert(i, {"kind": "env", "turn": turn, "start": at, "end": at, "tokens": 0,
                         "calls": [call_row(c) for c in left], "appended_by": []})
    if state.pending:  # the last model turn's calls without a result in the checkpoint
        env = next((t for t in turns if t["kind"] == "env" and t["start"] == state.at), None)
        if env is None:
            env = {"kind": "env", "turn": max(0, snap.turn - 1), "start": state.at, "end": state.at, "tokens": 0,
                   "calls": [], "appended_by": []}
            turns.append(env)
        env["pending"] = [{"key": c.key, "tool": c.name, "arguments": _short(c.arguments)} for c in state.pending]
    if n > pos >= 0 and not state.done:  # tokens past the state: a model turn under way
        turns.append({"kind": "model", "turn": snap.turn, "start": pos, "end": n, "tokens": n - pos, "worker": "",
                      "policy_version": -1, "weights": "", "parts": who("model", pos, n), "under_way": True})
    for e in events:
        if e.kind not in _SHOWN or not turns:
            continue
        at = next((t for t in turns if t["start"] <= e.offset < t["end"]), None)
        if at is None:  # at the very end, or an empty turn's offset
            at = next((t for t in turns if t["start"] == e.offset), turns[-1])
        at.setdefault("events", []).append({"kind": e.kind, "worker": e.worker_id, "epoch": e.epoch,
                                            "offset": e.offset, "ts": e.ts, "detail": e.detail})
    return turns


async def episode_reward(result: wire.RolloutResult, env: EnvSettings | None) -> dict | None:
    """The episode's reward as the trainer computes it (`EpisodeRunner.finish` on the final
    snapshot, never a score a worker wrote), when `env` names an environment that loads; None
    when none is named; `{"error": ...}` when it does not load or the episode is unfinished."""
    if env is None or not env.ref or result.episode is None:
        return None
    from rlboost.envs import load_env
    from rlboost.episodes.runner import EpisodeRunner

    try:
        snap = episodes.snapshot(result.episode)
        if snap.phase != "done":
            return {"error": f"the episode is unfinished ({snap.phase})"}
        snap.score = None
        done = await EpisodeRunner(load_env(env.ref, **env.options), None).finish(snap)  # type: ignore[arg-type]
    except RlboostError as e:
        return {"error": str(e)}
    return {"env": env.ref, "reward": done.reward, "turn_rewards": done.turn_rewards}


def print_episode(life: Life, turns: list[dict], reward: dict | None, running: tuple | None = None,
                  errors: list[str] | None = None, no_text: str = "") -> None:
    """The turns of a finished episode (`life.result`), or of a running one (`running`: its
    checkpoint's length and the state's summary), each model turn's `text` where the turns have
    it (else `no_text` says why, once), and the environment's `errors`."""
    r = life.result
    events = [e for e in life.events if e.kind not in _SHOWN]
    t0 = min([e.ts for e in life.events] + ([r.ts] if r else []) + [c.ts for c in life.chunks], default=time.time())
    model = [t for t in turns if t["kind"] == "model"]
    ncalls = sum(len(t.get("calls", [])) for t in turns)
    n = len(r.token_ids) if r else running[0] if running else 0
    print(f"episode {life.request_id}: {len(model)} model turns, {ncalls} tool calls, {n} tokens"
          + (f" after a {len(r.prompt_ids)}-token prompt" if r else " so far (running, from the checkpoint store)"))
    for e in events:
        if e.kind == "publish":
            print(f"  +{e.ts - t0:8.3f}s  published by {e.worker_id}")
    if no_text:
        print(f"  {no_text}")
    for t in turns:
        span = f"tokens {t['start']}..{t['end'] - 1} ({t['tokens']})" if t["tokens"] else "no tokens"
        if t["kind"] == "model" and t.get("under_way"):
            print(f"  turn {t['turn']} model  {span}: under way")
        elif t["kind"] == "model":
            print(f"  turn {t['turn']} model  {span}: {t['worker']} policy v{t['policy_version']} "
                  f"weights {t['weights'] or '-'}")
        if t["kind"] == "model":
            if len(t["parts"]) > 1 or t.get("under_way") or (t["parts"] and t["parts"][0]["worker"] != t["worker"]):
                for p in t["parts"]:
                    print(f"           {p['tokens']} tokens by {p['worker']} (epoch {p['epoch']}, "
                          f"v{p['policy_version']}, weights {p['weights'] or '-'})")
            if "text" in t:  # the model's own words, line by line under a bar: where a turn begins and ends
                for line in t["text"].split("\n"):
                    print(f"           | {line}")
        else:
            by = ",".join(sorted({p["worker"] for p in t["appended_by"]})) or "-"
            print(f"  turn {t['turn']} env    {span} appended by {by}")
            for c in t["calls"]:
                res = f"{c['result_chars']} chars: {c['result']!r}" if c["result"] is not None else "no result message"
                print(f"           tool {c['tool']}({c['arguments']}) key {c['key']} ran by {c['worker']} "
                      f"in {c['latency_s'] * 1000:.1f} ms{' ERROR' if c['error'] else ''} -> {res}")
            for c in t.get("pending", []):
                print(f"           tool {c['tool']}({c['arguments']}) key {c['key']}: pending (no result fenced in yet)")
        for e in t.get("events", []):
            what = {"claim": f"claimed by {e['worker']} (epoch {e['epoch']}) at token {e['offset']}",
                    "release": f"handed off by {e['worker']} at token {e['offset']} ({e['detail']})",
                    "fenced": f"{e['worker']} lost the lease (epoch {e['epoch']} stale) at token {e['offset']}"}
            print(f"           +{e['ts'] - t0:8.3f}s  {what[e['kind']]}")
    for e in events:
        if e.kind == "finish":
            print(f"  +{e.ts - t0:8.3f}s  finished by {e.worker_id} with {e.offset} tokens")
        elif e.kind == "deadletter":
            print(f"  +{e.ts - t0:8.3f}s  dead-lettered: {e.detail}")
    for err in errors or []:
        print(f"  environment error: {err}")
    if r is None or r.episode is None:
        print(f"  no result yet: {running[1] if running else '-'}, hand-offs: {life.handoffs()}")
        return
    print(f"  result: {r.finish_reason}{f' ({r.error})' if r.error else ''}, episode ended: "
          f"{r.episode.reason or '-'}, hand-offs: {life.handoffs()}")
    if reward is None:
        print("  reward: not on the streams (the trainer computes it); give --env to compute it here")
    elif "error" in reward:
        print(f"  reward: not computed ({reward['error']})")
    else:
        per = f", per turn {reward['turn_rewards']}" if reward["turn_rewards"] else ""
        print(f"  reward: {reward['reward']} (scored by {reward['env']}{per})")


async def check_streams(js: JetStreamContext, nats_url: str) -> None:
    """ReplayError when the servers hold none of the streams a replay reads: nothing has run there."""
    for name in READ_STREAMS:
        try:
            await js.stream_info(name)
            return
        except NotFoundError:
            continue
    shown = ",".join(bus._redact(u.strip()) for u in nats_url.split(","))  # never a password
    raise ReplayError(f"no rlboost streams on {shown}: nothing has run here "
                      "(is this the servers' URL? RLBOOST_NATS_URL, or the data dir of `rlboost up`)")


async def running_episode(redis_url: str, life: Life, services: ServicesSettings | None
                          ) -> tuple[list[dict] | None, tuple[int, str, list[int], wire.EpisodeState] | None]:
    """The turns of an episode with no result yet, from the checkpoint store (its fenced state,
    tokens and segments), and (its length, the state in words, its tokens, the state); (None,
    None) when it is no episode, or the store cannot be read."""
    from rlboost.checkpoint import CheckpointStore

    store = CheckpointStore(redis_url)
    try:
        state = await store.episode(life.request_id)
        if state is None:
            return None, None
        tokens, _ = await store.read(life.request_id)
        segments = await store.segments(life.request_id)
    except Exception:  # an unreachable store, a read the identity may not make: the streams' timeline
        return None, None
    finally:
        await store.close()
    turns = turns_of(state, segments, len(tokens), life.events)
    what = (f"turn {state.turn}, {len(state.pending)} tool call(s) pending" if state.pending
            else "ended, not finished" if state.done else f"turn {state.turn}")
    return turns, (len(tokens), what, list(tokens), state)


async def run(nats_url: str, a: argparse.Namespace, services: ServicesSettings | None = None,
              env: EnvSettings | None = None, redis_url: str = "", model_dir: str = "") -> int:
    """`a`: the request (or the step) and `--json`; `model_dir`: the run's model, whose tokenizer
    shows each model turn's text."""
    nc = await bus.connect(nats_url, name="rlboost-replay", services=services)
    try:
        js = nc.jetstream()
        await check_streams(js, nats_url)
        if a.request:
            m = _STEP.search(a.request)
            step = a.step if a.step is not None else (int(m.group(1)) if m else None)
            if step is None:
                print("rlboost replay: give --step for a request id not of the form [run-]s<step>-p<n>-g<n>")
                return 2
            life = await life_of(js, step, a.request)
            if not (life.events or life.chunks or life.result):
                print(f"nothing on the streams for {a.request} in step {step}")
                return 1
            turns, running = episode_turns(life), None
            if turns is None and life.result is None and redis_url:
                turns, running = await running_episode(redis_url, life, services)
            if turns is None:
                print(json.dumps(life.summary())) if a.json else print_timeline(life)
                return 0
            reward = await episode_reward(life.result, env) if life.result else None
            state = life.result.episode if life.result else running[3] if running else None
            errors = episode_errors(state) if state is not None else []
            tokenizer, no_text = load_tokenizer(model_dir)
            if tokenizer is not None:
                add_text(turns, list(life.result.token_ids) if life.result else running[2] if running else [],
                         tokenizer)
            if a.json:
                print(json.dumps({**life.summary(), "turns": turns, "reward": reward, "errors": errors,
                                  "text": no_text or "decoded", "running": running[1] if running else None}))
            else:
                print_episode(life, turns, reward, running, errors, no_text)
            return 0
        lives = await step_lives(js, a.step)
        rows = [life.summary() for _, life in sorted(lives.items())]
        if a.json:
            print(json.dumps(rows))
            return 0
        done = sum(r["finished"] for r in rows)
        print(f"step {a.step}: {len(rows)} requests seen, {done} finished, "
              f"{sum(r['handoffs'] for r in rows)} hand-offs")
        for r in rows:
            print(f"  {r['request_id']}  {'done' if r['finished'] else 'OPEN':4}  tokens={r['result_tokens']}  "
                  f"claims={r['claims']}  hand-offs={r['handoffs']}  workers={','.join(r['workers'])}")
        return 0
    finally:
        await nc.close()


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost replay", description=__doc__.splitlines()[0])
    p.add_argument("request", nargs="?", help="request id, e.g. s00003-p00012-g005")
    p.add_argument("--step", type=int, help="the step (a step summary when no request is given)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--env", help="an episode's environment (module:fn, file.py:fn or a built-in), to compute its "
                                 "reward; default: the settings' [env] ref, with [env.options]")
    p.add_argument("--model-dir", help="the run's model folder, whose tokenizer decodes each model turn's text; "
                                       "default: --run-dir's, else the settings' run.model_dir")
    p.add_argument("--run-dir", help="the run's folder: its settings.toml names the model and the environment "
                                     "(over the settings'; --model-dir and --env over it)")
    a = p.parse_args(argv)
    if not a.request and a.step is None:
        p.error("give a request id or --step")
    nats_url, redis_url = resolve_urls(s.services)
    if a.run_dir:  # the run's own settings: the model it ran (resolved: the demo's too), its environment
        try:
            ran = load_settings(Path(a.run_dir) / "settings.toml", environ={})
        except ConfigError as e:
            p.error(f"--run-dir {a.run_dir}: {e}")
        s = msgspec.structs.replace(s, env=ran.env if ran.env.ref else s.env,
                                    run=msgspec.structs.replace(s.run, model_dir=ran.run.model_dir or s.run.model_dir))
    env = s.env if not a.env else EnvSettings(ref=a.env, options=s.env.options if a.env == s.env.ref else {})
    return asyncio.run(run(nats_url, a, s.services, env, redis_url, a.model_dir or s.run.model_dir))
