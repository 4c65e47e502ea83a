"""Episodes: multi-turn, tool-using rollouts (docs/concepts/environments.md), the core's part.

- `runner`: the engine-agnostic episode runner (`EpisodeRunner`: begin, model turns, tools,
  finish), resumable after any phase from a JSON `Snapshot`;
- `state`: the runner's snapshot in the fenced episode state (`wire.EpisodeState`) without a
  second copy of its tokens (`pack`, `unpack`, `snapshot`, `layout`), and a request for an
  episode (`request`).

The environment protocol the runner calls is `rlboost.envs` (an environment is the user's; an
episode is rlboost's). Each side of the dataflow has the rest of the concept under the same name:
`rlboost.workers.episodes` (a worker playing episodes, inline tools) and `rlboost.trainer.episodes`
(a run's episode rows, requests, scores, held-out evaluation and warm start).
"""

from rlboost.episodes.state import EpisodeStateError, layout, pack, request, snapshot, unpack

__all__ = ["EpisodeStateError", "layout", "pack", "request", "snapshot", "unpack"]
