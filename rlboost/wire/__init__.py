"""The wire contract: every subject, stream, consumer, KV bucket, message type and Redis key.

Everything that crosses a process boundary is defined in this package and nowhere else, so a
reader can learn the whole protocol here, in three files read in order: `names.py` (the schema
version, streams, subjects, consumers, buckets, ids and Redis keys), `messages.py` (the msgspec
structs) and `codec.py` (`encode`, and `decode`: the one door for wire bytes, which validates).
Messages are encoded as MessagePack; each carries the schema version `v`, checked before the
body is decoded, so a peer speaking another version is refused with a clear reason instead of
being misread. Code imports the package (`from rlboost import wire`; `wire.RolloutRequest`).
"""

from rlboost.wire.names import (
    STREAMS, SCHEMA_VERSION, WireError, SchemaVersionError, STREAM_REQUESTS, STREAM_TOKENS, STREAM_RESULTS,
    STREAM_EVENTS, STREAM_DLQ, BUCKET_WORKERS, BUCKET_POLICY, BUCKET_CONTROL, BUCKET_RUN,
    RUN_LEASE_KEY, request_subject, token_subject, token_steps_subject, result_subject,
    event_subject, dlq_subject, resume_subject, env_subject, ENV_FILTER, ENV_CONSUMER,
    env_lane_pool, consumer_name, resume_consumer_name, is_handoff_subject, handoff_msg_id,
    env_handoff_msg_id, env_return_msg_id, HDR_MSG_ID, HDR_DLQ_REASON, HDR_DLQ_SUBJECT,
    HDR_DLQ_SEQ, check_name, check_weights_id, event_msg_id, request_id, new_run_id,
    BUCKET_WEIGHTS, WEIGHTS_POINTER_KEY, weights_shard_key, weights_delta_key,
    weights_manifest_key, weights_snapshot_delta_key, BUCKET_PEERS, peer_blob_key,
    peer_version_key, parse_s3_url, StreamSpec, stream_of, ConsumerSpec, RECORD, ckpt_tokens_key,
    ckpt_meta_key, ckpt_lease_key, ckpt_append_keys, ckpt_history_key, ckpt_episode_key,
)
from rlboost.wire.messages import (
    SamplingParams, EpisodeSpec, RolloutRequest, spec_digest, TokenChunk, FlushChunk, flush_msg_id,
    FLUSH_MESSAGE_BYTES, split_flush, TokenFlush, Segment, MAX_TOOL_CALLS_PER_TURN,
    MAX_EPISODE_STATE_BYTES, ToolCall, ToolRecord, EpisodeState, tool_call_key, check_tool_key,
    RolloutResult, result_msg_id, finish_reason, is_complete, token_versions, trainable_mask,
    token_turns, WorkerHeartbeat, Control, CONTROL_ALL, control, VersionFloor, version_floor_key,
    LeaseEvent, RunLease, Message,
)
from rlboost.wire.codec import (
    encode, MAX_MESSAGE_BYTES, MAX_TOKEN_ID, MAX_NEW_TOKENS, decode, MAX_TURNS,
)

__all__ = [
    "STREAMS", "SCHEMA_VERSION", "WireError", "SchemaVersionError", "STREAM_REQUESTS", "STREAM_TOKENS",
    "STREAM_RESULTS", "STREAM_EVENTS", "STREAM_DLQ", "BUCKET_WORKERS", "BUCKET_POLICY",
    "BUCKET_CONTROL", "BUCKET_RUN", "RUN_LEASE_KEY", "request_subject", "token_subject",
    "token_steps_subject", "result_subject", "event_subject", "dlq_subject", "resume_subject",
    "env_subject", "ENV_FILTER", "ENV_CONSUMER", "env_lane_pool", "consumer_name",
    "resume_consumer_name", "is_handoff_subject", "handoff_msg_id", "env_handoff_msg_id",
    "env_return_msg_id", "HDR_MSG_ID", "HDR_DLQ_REASON", "HDR_DLQ_SUBJECT", "HDR_DLQ_SEQ",
    "check_name", "check_weights_id", "event_msg_id", "request_id", "new_run_id", "BUCKET_WEIGHTS",
    "WEIGHTS_POINTER_KEY", "weights_shard_key", "weights_delta_key", "weights_manifest_key",
    "weights_snapshot_delta_key", "BUCKET_PEERS", "peer_blob_key", "peer_version_key",
    "parse_s3_url", "StreamSpec", "stream_of", "ConsumerSpec", "RECORD", "ckpt_tokens_key",
    "ckpt_meta_key", "ckpt_lease_key", "ckpt_append_keys", "ckpt_history_key", "ckpt_episode_key",
    "SamplingParams", "EpisodeSpec", "RolloutRequest", "spec_digest", "TokenChunk", "FlushChunk",
    "flush_msg_id", "FLUSH_MESSAGE_BYTES", "split_flush", "TokenFlush", "Segment",
    "MAX_TOOL_CALLS_PER_TURN", "MAX_EPISODE_STATE_BYTES", "ToolCall", "ToolRecord", "EpisodeState",
    "tool_call_key", "check_tool_key", "RolloutResult", "result_msg_id", "finish_reason",
    "is_complete", "token_versions", "trainable_mask", "token_turns", "WorkerHeartbeat", "Control",
    "CONTROL_ALL", "control", "VersionFloor", "version_floor_key", "LeaseEvent", "RunLease",
    "Message", "encode", "MAX_MESSAGE_BYTES", "MAX_TOKEN_ID", "MAX_NEW_TOKENS", "decode",
    "MAX_TURNS",
]
