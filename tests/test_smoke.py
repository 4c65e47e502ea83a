"""The dataflow smoke end to end: every request yields exactly one result, even when published twice."""

from __future__ import annotations

from rlboost import wire
from rlboost.smoke import run_smoke


async def test_each_request_yields_exactly_one_result(nats_url, redis_url, js):
    out = await run_smoke(nats_url, redis_url, n=120, step=4242)
    assert out["results"] == 120 and out["missing"] == 0 and out["duplicated"] == 0
    info = await js.stream_info(wire.STREAM_RESULTS)
    assert info.state.messages == 120  # the second publish of each was dropped by the stream
