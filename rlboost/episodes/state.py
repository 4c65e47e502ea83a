"""An episode's checkpoint form: the runner's snapshot (rlboost/episodes/runner.py) in the fenced
episode state (`wire.EpisodeState`), without a second copy of its tokens.

The tokens of an episode live once, in its token checkpoint (model and environment tokens after
the prompt, typed by the history). The runner's snapshot holds them too, per segment; stored as
is, every turn would rewrite the whole episode as JSON (a 4k-token episode: ~100 KB per write).
So the stored snapshot keeps each segment's kind and length, not its tokens (`pack`), and a
claim puts the tokens back from the checkpoint (`unpack`): the request's prompt, then the
checkpoint's tokens and behaviour logprobs, exactly the float32 values every worker reads.

What a trainer needs from a finished episode (its messages, the environment's state, why it
ended, per-turn rewards) is in the snapshot without its tokens: `snapshot(result.episode)`.
A publisher makes an episode's request with `request` (the opening in the model's chat format
is its prompt; the bounds of the runner's settings travel with it, so every worker that
continues the episode ends it the same way).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from rlboost import wire
from rlboost.episodes.runner import EpisodeRunner, Snapshot
from rlboost.errors import RlboostError


class EpisodeStateError(RlboostError, ValueError):
    """A stored episode state that does not describe its checkpoint (or is not a snapshot)."""


class _Stored(msgspec.Struct, kw_only=True):
    """`EpisodeState.env_state`: the snapshot, its segments' tokens left out, and their lengths."""

    snapshot: Any
    lengths: list[int]


def pack(snap: Snapshot) -> str:
    """The snapshot as `EpisodeState.env_state` JSON: its segments without their tokens."""
    lengths = [len(s.token_ids) for s in snap.segments]
    stripped = msgspec.structs.replace(snap, segments=[msgspec.structs.replace(s, token_ids=[], logprobs=[])
                                                       for s in snap.segments])
    return msgspec.json.encode(_Stored(snapshot=stripped, lengths=lengths)).decode()


def snapshot(state: wire.EpisodeState) -> Snapshot:
    """The stored snapshot, segments without their tokens (what scoring needs: messages, state)."""
    return _split(state)[0]


def layout(state: wire.EpisodeState) -> tuple[Snapshot, list[int]]:
    """The stored snapshot (segments without their tokens) and each segment's length: where
    every turn lies in the token stream (what `rlboost replay` shows of an episode)."""
    return _split(state)


def _split(state: wire.EpisodeState) -> tuple[Snapshot, list[int]]:
    try:
        stored = msgspec.json.decode(state.env_state, type=_Stored)
        snap = Snapshot.decode(msgspec.json.encode(stored.snapshot))
    except (msgspec.DecodeError, msgspec.ValidationError, RlboostError) as e:
        raise EpisodeStateError(f"the episode state is not a snapshot: {e}") from None
    if len(stored.lengths) != len(snap.segments) or any(n < 0 for n in stored.lengths):
        raise EpisodeStateError("the episode state's segment lengths do not match its segments")
    return snap, stored.lengths


def unpack(state: wire.EpisodeState, prompt_ids: list[int], token_ids: list[int], logprobs: list[float]) -> Snapshot:
    """The runner's snapshot from a stored state and its checkpoint: the request's `prompt_ids`
    then the checkpoint's tokens and logprobs (at least `state.at` of them: tokens past it are a
    model turn under way, which the snapshot does not hold yet)."""
    snap, lengths = _split(state)
    stream = list(prompt_ids) + list(token_ids[:state.at])
    lps = [0.0] * len(prompt_ids) + list(logprobs[:state.at])
    if len(token_ids) < state.at or sum(lengths) != len(stream):
        raise EpisodeStateError(f"the episode state describes {sum(lengths)} tokens, the prompt and checkpoint "
                                f"hold {len(prompt_ids)} + {min(len(token_ids), state.at)}")
    if snap.segments and (snap.segments[0].kind != "prompt" or lengths[0] != len(prompt_ids)):
        raise EpisodeStateError("the episode state's first segment is not the request's prompt")
    at, segments = 0, []
    for seg, n in zip(snap.segments, lengths, strict=True):
        segments.append(msgspec.structs.replace(seg, token_ids=stream[at:at + n],
                                                logprobs=lps[at:at + n] if seg.kind == "model" else []))
        at += n
    snap.segments = segments
    return snap


async def request(runner: EpisodeRunner, env_ref: str, row: dict[str, Any], *, request_id: str, step: int,
                  policy_version: int, seed: int, group: int = 0, env_options: dict[str, Any] | None = None,
                  sampling: wire.SamplingParams = wire.SamplingParams()) -> wire.RolloutRequest:
    """The request of one episode of `runner`'s environment (loaded from `env_ref` with
    `env_options`, by default the runner's settings' `options`) from data row `row`: its prompt
    is the opening (`begin`) in the runner's chat
    format, which a worker with the same model renders alike and checks; `max_new_tokens` is
    what the runner's `max_episode_tokens` leaves after the prompt. EpisodeStateError if the
    environment cannot open the episode."""
    snap = await runner.begin(request_id, row)
    if not snap.segments:
        raise EpisodeStateError(f"{request_id}: the environment did not open the episode: {'; '.join(snap.errors)}")
    prompt = list(snap.segments[0].token_ids)
    s = runner.settings
    return wire.RolloutRequest(
        request_id=request_id, step=step, policy_version=policy_version, prompt_ids=prompt, seed=seed, group=group,
        max_new_tokens=max(1, s.max_episode_tokens - len(prompt)), stop_ids=list(runner.fmt.stop_ids),
        sampling=sampling,
        episode=wire.EpisodeSpec(env=env_ref, row=json.dumps(row), config=json.dumps(runner.settings.options if env_options is None else env_options),
                                 max_turns=s.max_turns, max_turn_tokens=runner.max_turn_tokens,
                                 tool_timeout_s=s.tool_timeout_s, on_tool_error=s.on_tool_error))  # type: ignore[arg-type]
