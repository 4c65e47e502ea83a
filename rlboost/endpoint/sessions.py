"""The session files: one JSONL per session under `<run dir>/sessions`, one line per answered
choice (fsynced before the answer goes out) and one per reported reward; how the endpoint keeps
a session's turns and token stream across calls (and restarts), and how a trainer reads them back.

Why a file per session and not the results stream alone: the results stream already holds every
call's tokens durably (and `rlboost replay` reads it), but not what makes a call part of an
episode: the session, the call's turn in it, the parsed tool calls and the reward the harness
reports. Those are facts only the endpoint knows; one file per session, in call order, is what
a trainer reads as an episode (`read_sessions`), without NATS, and the token-level truth in it
was checked against Redis before it was written.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlboost import wire
from rlboost.endpoint.errors import EndpointError
from rlboost.envs.protocol import Message, ToolSpec

RECORD_VERSION = 1  # the schema of a session file's lines (`read_sessions`)
MAX_SESSIONS_CACHED = 4096  # sessions whose last answer is kept in memory (the rest re-read their file)


def conversation_digest(messages: list[Message], tools: list[ToolSpec]) -> str:
    """What identifies a conversation (messages and tools, tool-call indices aside): a call whose
    messages are an earlier call's plus its answer continues that call's token stream."""
    canon = [{"role": m.role, "content": m.content, "tool_call_id": m.tool_call_id, "name": m.name,
              "calls": [[c.key, c.name, c.arguments] for c in m.tool_calls]} for m in messages]
    data = json.dumps({"messages": canon, "tools": [t.openai() for t in tools]}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(data.encode()).hexdigest()[:32]


def token_stream(rec: dict) -> list[int]:
    """The token stream a recorded call leaves for the next call to extend: its prompt, its
    completion and, for a turn cut by max_tokens, the end-of-turn token that closes it."""
    return rec["prompt_ids"] + rec["completion_ids"] + rec.get("closing_ids", [])


@dataclass
class Session:
    """One session file, read back: its calls (one dict per choice, in call order) and the last
    reward the harness reported (None: none yet)."""

    session: str
    calls: list[dict] = field(default_factory=list)
    reward: float | None = None
    metrics: dict = field(default_factory=dict)
    done: bool = False

    def results(self) -> list[wire.RolloutResult]:
        """The session's calls as the trainer takes rollouts (`GRPOTrainer.add_group`): one
        result per recorded choice the engine served, each its call's prompt and completion with
        the behaviour logprobs and the segments (who generated which tokens, with which version:
        the per-token staleness). Every call's prompt holds the turns before it, and prompts are
        never trained, so training each call with its session's reward trains the episode's model
        tokens and nothing the harness added."""
        return [wire.RolloutResult(
            request_id=c["request_id"], step=c["step"], group=c["group"], prompt_ids=c["prompt_ids"],
            token_ids=c["completion_ids"], logprobs=c["logprobs"], finish_reason=c["finish_reason"],
            segments=[wire.Segment(offset=g["offset"], worker_id=g["worker_id"], epoch=g["epoch"],
                                   policy_version=g["policy_version"], weights=g["weights"],
                                   kind=g.get("kind", "model")) for g in c["segments"]],
            worker_id=c["worker_id"], epoch=c["epoch"], ts=c["ts"]) for c in self.calls if c["finish_reason"] != "error"]

    def episode(self) -> dict | None:
        """The session as one token stream, as the native episode protocol records it: the last
        call's prompt and completion, where every call's prompt continued the one before it
        (`extends`: its tokens start with the previous call's prompt and completion, exactly).
        `mask` is 1 on the model's tokens (each call's completion), 0 on the prompt and on what
        the harness added between calls (tool results, user turns): those are never trained.
        `logprobs` and `token_versions` are the engines' on model tokens (0.0 and -1 elsewhere).
        The chain is followed back from the last call: where the harness rewrote its history,
        the stream starts at the first call after the rewrite (`request_ids` says which calls it
        holds). None when a call it names is not in the file, or when one of its calls was one
        the engine could not serve (`finish_reason` error: nothing to train on)."""
        if not self.calls:
            return None
        by_id = {c["request_id"]: c for c in self.calls}
        chain = [self.calls[-1]]
        while chain[-1].get("extends"):
            prev = by_id.get(chain[-1]["extends"]["request_id"])
            if prev is None:
                return None
            chain.append(prev)
        chain.reverse()
        if any(c["finish_reason"] == "error" for c in chain):
            return None
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for c in chain:
            if c["prompt_ids"][:len(ids)] != ids:
                return None
            new = c["prompt_ids"][len(ids):]
            ids += new + c["completion_ids"]
            mask += [0] * len(new) + [1] * len(c["completion_ids"])
            logprobs += [0.0] * len(new) + list(c["logprobs"])
            versions += [-1] * len(new) + list(c["token_versions"])
        return {"session": self.session, "token_ids": ids, "mask": mask, "logprobs": logprobs,
                "token_versions": versions, "request_ids": [c["request_id"] for c in chain],
                "prompt_tokens": len(chain[0]["prompt_ids"]), "reward": self.reward}


def read_session(path: str | os.PathLike[str]) -> Session:
    """A session file's records. A last line cut short (the endpoint died while writing it; its
    call was never answered) is skipped; any other line that does not parse raises."""
    p = Path(path)
    out = Session(session=p.stem)
    lines = p.read_bytes().split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: the torn tail of a write that never finished
                break
            raise EndpointError(f"{p}: line {i + 1} is not JSON") from None
        if rec.get("kind") == "call":
            out.calls.append(rec)
        elif rec.get("kind") == "reward":
            out.reward, out.metrics, out.done = rec.get("reward"), rec.get("metrics") or {}, bool(rec.get("done"))
    return out


def read_sessions(run_dir: str | os.PathLike[str]) -> list[Session]:
    """Every session an endpoint recorded under `run_dir`, by session id."""
    return [read_session(p) for p in sorted((Path(run_dir) / "sessions").glob("*.jsonl"))]


def cut_torn_tail(path: Path) -> None:
    """An endpoint that died while writing a line left it without its newline (that call was
    never answered): cut it off before appending, or the next line would be glued to it."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass


def append_lines(path: Path, lines: list[dict]) -> None:
    data = b"".join(json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for rec in lines)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)



@dataclass
class SessionState:
    """What the endpoint keeps of a session between calls."""

    next_turn: int = 0
    # conversation digest (the call's messages + one choice's answer) -> (that stream's tokens, request id)
    tails: dict[str, tuple[list[int], str]] = field(default_factory=dict)
    recorded: dict[str, int] = field(default_factory=dict)  # request id -> turn, of every recorded call

    def turn_for(self, request_id: str) -> tuple[int, bool]:
        """The turn of the call whose first request is `request_id`, and whether it is recorded
        already (a retry of an answered call keeps its turn and is not written twice)."""
        before = self.recorded.get(request_id)
        return (self.next_turn, False) if before is None else (before, True)


class SessionBook:
    """The session files of one run dir: each session's state (read back from its file once after
    a restart, the most recently used kept in memory), a lock per session (its turns are numbered
    and written in the order its calls finish) and the appends."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "sessions"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._states: dict[str, SessionState] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def path(self, session: str) -> Path:
        return self.dir / f"{session}.jsonl"

    def lock(self, session: str) -> asyncio.Lock:
        return self._locks.setdefault(session, asyncio.Lock())

    def state(self, session: str) -> SessionState:
        """The session's next turn and last answers, read from its file once after a restart."""
        st = self._states.pop(session, None)
        if st is None:
            path = self.path(session)
            cut_torn_tail(path)
            calls = read_session(path).calls if path.exists() else []
            st = SessionState(next_turn=1 + max((c.get("turn", -1) for c in calls), default=-1),
                              recorded={c["request_id"]: c["turn"] for c in calls})
            last = [c for c in calls if c.get("turn") == st.next_turn - 1]
            st.tails = {c["answer_digest"]: (token_stream(c), c["request_id"]) for c in last if c.get("answer_digest")}
            while len(self._states) >= MAX_SESSIONS_CACHED:
                old = next(iter(self._states))
                self._states.pop(old)
                lock = self._locks.get(old)
                if lock is not None and not lock.locked():
                    del self._locks[old]
        self._states[session] = st  # most recently used last
        return st

    async def record_turn(self, session: str, state: SessionState, turn: int, records: list[dict],
                          written: bool) -> None:
        """A call's choices, as the turn `turn` (under the session's lock): appended and fsynced
        unless `written` already; their answers become the tails the next call may extend."""
        if not written:
            await asyncio.to_thread(append_lines, self.path(session), records)
            state.next_turn = turn + 1
            state.recorded.update((rec["request_id"], turn) for rec in records)
        state.tails = {rec["answer_digest"]: (token_stream(rec), rec["request_id"]) for rec in records
                       if rec["answer_digest"]}

    async def record_reward(self, session: str, reward: float, metrics: dict, done: bool) -> None:
        path = self.path(session)
        async with self.lock(session):
            if not path.exists():
                raise EndpointError(f"no session {session!r}: it made no call", 404, kind="not_found_error")
            self.state(session)  # a torn tail (an endpoint that died mid-write) is cut first
            await asyncio.to_thread(append_lines, path, [{
                "v": RECORD_VERSION, "kind": "reward", "session": session, "reward": reward,
                "metrics": metrics, "done": done, "ts": time.time()}])
