"""`rlboost serve-openai`: an OpenAI-compatible chat-completions endpoint backed by the dataflow.

An agent loop rlboost does not own (the `verifiers` harness, OpenEnv, a user's own scaffold)
points its OpenAI client at this server and drives episodes; every call is a rollout request
like any other:

1. the messages (and `tools=`) become prompt token ids through the model's own chat template
   (`rlboost.envs.chat.chat_format`) (parse.py: the request; chat.py: the prompt);
2. one `wire.RolloutRequest` per choice (`n`) goes on the pool's work queue, and its result
   comes back verified against its checkpoint (bridge.py);
3. the answer is decoded, parsed for tool calls in the template's syntax, and recorded: one JSON
   line per choice in `<run dir>/sessions/<session>.jsonl`, fsynced before the answer goes out
   (sessions.py, which also reads them back for a trainer: `read_sessions`);
4. the answer is the OpenAI response shape plus an `rlboost` field with the request ids, token
   ids, logprobs and policy versions (chat.py), served over aiohttp (server.py); with
   `stream: true`, as server-sent `chat.completion.chunk` events cut from the recorded answer
   (stream.py: the stream starts once the turn is durable and recorded, keep-alive comments
   before).

A training run (`rlboost run --harness`, rlboost.trainer.harness_task) makes its endpoint
`bindable` and binds one session per harness process (`OpenAIEndpoint.bind`): that session's
calls are requests of the run's step, in its row's GRPO group, under the step's version, and its
own API key pins its calls and its reward report to it.

Guarantees (docs/guides/agent-harnesses.md): a model turn is durable (checkpointed tokens,
resumed on any worker); the harness's own state (its loop, its tools' side effects, the
conversation it holds) is not: a harness that dies loses its episode. A call the endpoint never
answered (it died) is the harness's to retry; with the same `Idempotency-Key` header the retry
names the same requests, so the turn comes from its checkpoint instead of being generated again.
"""

from rlboost.endpoint.command import main, serve
from rlboost.endpoint.errors import EndpointError
from rlboost.endpoint.parse import ChatCall, parse_call, parse_messages, parse_tools, session_id
from rlboost.endpoint.server import OpenAIEndpoint
from rlboost.endpoint.sessions import RECORD_VERSION, Session, conversation_digest, read_session, read_sessions

__all__ = ["OpenAIEndpoint", "EndpointError", "Session", "read_session", "read_sessions", "RECORD_VERSION",
           "ChatCall", "parse_call", "parse_messages", "parse_tools", "session_id", "conversation_digest",
           "main", "serve"]
