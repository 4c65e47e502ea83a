"""The torch engine keeps the determinism contract: a request's tokens depend only on (seed,
request id, position, prefix, weights), never on batching, chunking or which engine resumes it."""

from __future__ import annotations

import random
import threading
import warnings

import pytest
import torch
from helpers import assert_wrong_shape_refused_untouched, engine_requests, fresh

from rlboost.trainer.model import build_model, build_tokenizer, init_model_dir, save
from rlboost.trainer.tasks import Addition
from rlboost.workers.engines.base import Sequence
from rlboost.workers.engines.torch_engine import PrefixCache, TorchEngine, gumbel_noise

torch.set_num_threads(1)
MAX_NEW = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # An untrained model: near-flat distributions make samples as fragile as they get.
    return init_model_dir(tmp_path_factory.mktemp("model"), Addition(), seed=11, hidden=64, layers=2, heads=4,
                          mlp=128)


@pytest.fixture(scope="module")
def engine(model_dir):
    return TorchEngine(str(model_dir))


def _requests(n: int, rng: random.Random, **overrides) -> list[Sequence]:
    sampling = [dict(), dict(temperature=0.7), dict(top_k=4), dict(top_p=0.8), dict(temperature=1.3, top_p=0.9),
                dict(temperature=0.0)]
    return engine_requests(n, rng, MAX_NEW, sampling, **overrides)


async def _one_go(engine: TorchEngine, seqs: list[Sequence]):
    """Each request alone, in a single call: the reference."""
    return [(await engine.generate([fresh(s)], MAX_NEW))[0] for s in seqs]


async def test_pieces_in_mixed_batches_equal_one_go(engine):
    rng = random.Random(0)
    seqs = _requests(12, rng)
    reference = await _one_go(engine, seqs)
    assert len({tuple(r.token_ids) for r in reference}) == len(seqs)
    state = {s.request_id: fresh(s) for s in seqs}
    logprobs = {s.request_id: [] for s in seqs}
    finished: set[str] = set()
    while len(finished) < len(seqs):
        pending = [s for rid, s in state.items() if rid not in finished]
        members = rng.sample(pending, rng.randint(1, len(pending)))
        decoys = _requests(rng.randint(0, 4), random.Random(rng.random()), max_new_tokens=40)
        for d in decoys:
            d.request_id = f"decoy-{rng.randrange(10**6)}"
        batch = members + decoys
        rng.shuffle(batch)
        results = await engine.generate(batch, rng.randint(1, 7))
        for s, g in zip(batch, results, strict=True):
            if s.request_id in state:
                s.token_ids += g.token_ids
                logprobs[s.request_id] += g.logprobs
                if g.finished:
                    finished.add(s.request_id)
    for s, ref in zip(seqs, reference, strict=True):
        assert state[s.request_id].token_ids == ref.token_ids
        assert logprobs[s.request_id] == pytest.approx(ref.logprobs, rel=0, abs=1e-9)


async def test_generation_warns_nothing(engine):
    """No FutureWarning/DeprecationWarning from the model's forward (transformers 5 deprecated
    `past_key_values` for `cache`); "always" so a warning already shown by an earlier test counts."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = await engine.generate(_requests(3, random.Random(5)), MAX_NEW)
    assert all(g.token_ids for g in out)
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []


async def test_resumed_in_a_fresh_engine_continues_exactly(model_dir, engine):
    seqs = _requests(6, random.Random(1))
    reference = await _one_go(engine, seqs)
    other = TorchEngine(str(model_dir))
    cuts = [1, 5, 9, 13, 17, 23]
    resumed = await other.generate([fresh(s, ref.token_ids[:k]) for s, ref, k in zip(seqs, reference, cuts)],
                                   MAX_NEW)
    for ref, k, got in zip(reference, cuts, resumed, strict=True):
        assert got.token_ids == ref.token_ids[k:]
        assert got.finished


async def test_logprobs_are_under_the_temperature_scaled_distribution(model_dir, engine):
    """Checked against a plain full forward pass, without cache or padding."""
    seqs = _requests(6, random.Random(2))
    results = await engine.generate([fresh(s) for s in seqs], 8)
    for s, g in zip(seqs, results, strict=True):
        ids = torch.tensor([s.prompt_ids + g.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1: -1].double()
        t = s.temperature if s.temperature > 0 else 1.0
        want = torch.log_softmax(logits / t, -1).gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert g.logprobs == pytest.approx(want.tolist(), abs=1e-9)
        if s.temperature == 0:
            assert g.token_ids == logits.argmax(-1).tolist()


async def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    base = _requests(1, random.Random(3), temperature=0.0)[0]
    greedy = (await engine.generate([fresh(base)], MAX_NEW))[0].token_ids
    for kw in (dict(top_k=1), dict(top_p=1e-9)):
        s = fresh(base)
        s.temperature, s.top_k, s.top_p = 1.0, kw.get("top_k", 0), kw.get("top_p", 1.0)
        assert (await engine.generate([s], MAX_NEW))[0].token_ids == greedy


async def test_max_new_tokens_eos_and_budget(engine):
    s = _requests(1, random.Random(4))[0]
    full = (await engine.generate([fresh(s)], 100))[0]
    assert len(full.token_ids) == MAX_NEW and full.finished  # stops at max_new_tokens, not the budget

    part = (await engine.generate([fresh(s)], 5))[0]
    assert part.token_ids == full.token_ids[:5] and not part.finished

    # A stop token that the no-eos run emits at position j: the run now ends there, eos included.
    j = 3
    eos = full.token_ids[j]
    j = full.token_ids.index(eos)
    stopped = fresh(s)
    stopped.eos_id = eos
    got = (await engine.generate([stopped], 100))[0]
    assert got.token_ids == full.token_ids[: j + 1] and got.finished

    stopped.token_ids = got.token_ids  # already finished: nothing more, still finished
    again = (await engine.generate([stopped, fresh(s, full.token_ids)], 10))
    assert [(g.token_ids, g.finished) for g in again] == [([], True), ([], True)]


async def test_stop_event_returns_tokens_made_so_far(model_dir):
    stop = threading.Event()
    engine = TorchEngine(str(model_dir), on_tokens=lambda n: stop.set())
    seqs = _requests(3, random.Random(5))
    out = await engine.generate([fresh(s) for s in seqs], MAX_NEW, stop=stop)
    assert [len(g.token_ids) for g in out] == [1, 1, 1] and not any(g.finished for g in out)
    out = await engine.generate([fresh(s) for s in seqs], MAX_NEW, stop=stop)
    assert all(g.token_ids == [] for g in out)


async def test_load_weights_changes_outputs_and_back(model_dir, tmp_path):
    engine = TorchEngine(str(model_dir))
    seqs = _requests(4, random.Random(6))
    before = await _one_go(engine, seqs)
    tok = build_tokenizer(Addition().alphabet)
    other = build_model(len(tok), seed=99, hidden=64, layers=2, heads=4, mlp=128)
    save(other, tok, tmp_path / "v1")
    await engine.load_weights(tmp_path / "v1", version=1)
    assert engine.policy_version == 1
    after = await _one_go(engine, seqs)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    await engine.load_weights(model_dir, version=2)
    assert [g.token_ids for g in await _one_go(engine, seqs)] == [g.token_ids for g in before]


async def test_weights_that_do_not_fit_are_refused_untouched(model_dir, tmp_path):
    engine = TorchEngine(str(model_dir))
    await assert_wrong_shape_refused_untouched(engine, _requests(2, random.Random(7)), _one_go, tmp_path / "wrong", 4)


def test_gumbel_noise_is_keyed_and_gumbel_distributed():
    a = gumbel_noise([1, 2], [0, 0], 4096)
    assert torch.equal(a, gumbel_noise([1, 2], [0, 0], 4096))
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a[0], gumbel_noise([1], [1], 4096)[0])
    assert a.mean().item() == pytest.approx(0.5772, abs=0.05)  # Euler-Mascheroni
    assert a.std().item() == pytest.approx(torch.pi / 6**0.5, abs=0.05)


async def test_reload_from_a_folder_rebuilt_from_a_delta(model_dir, tmp_path):
    """A version the weight cache rebuilt from the previous one plus a bf16 delta loads as is."""
    from rlboost.weights import FileBlobStore, WeightCache, WeightPublisher, load_tensors

    engine = TorchEngine(str(model_dir))
    tied = {"lm_head.weight"} if engine.model.config.tie_word_embeddings else set()
    start = {k: v.to(torch.bfloat16) for k, v in engine.model.state_dict().items() if k not in tied}
    store = FileBlobStore(tmp_path / "store", create=True)
    pub = WeightPublisher(store)
    await pub.publish(start, 0)
    moved = {k: (v.float() + 0.01 * (v.float().abs() > 0.05)).to(v.dtype) if v.is_floating_point() else v
             for k, v in start.items()}
    rep = await pub.publish(moved, 1)
    assert rep.kind == "delta"
    cache = WeightCache(tmp_path / "cache", store)
    await cache.ensure(0)
    vv = await cache.ensure(1)
    assert cache.stats.reconstructed == 1
    await engine.load_weights(vv.path, 1)
    got = engine.model.state_dict()
    for k, v in moved.items():
        assert torch.equal(got[k].to(torch.bfloat16), v), k
    assert load_tensors(vv.path, expect_version=1).keys() == moved.keys()


async def _in_turns(engine: TorchEngine, seqs: list[Sequence], between=None) -> list[tuple[list[int], list[float]]]:
    """Each request generated 5 tokens a call, 3 'tool result' tokens appended after each call (as
    an episode's environment turn is), `between(call)` run between calls."""
    state = [fresh(s) for s in seqs]
    logprobs: list[list[float]] = [[] for _ in seqs]
    for call in range(4):
        for s, g in zip(state, await engine.generate(state, 5), strict=True):
            s.token_ids += g.token_ids + [3, 4, 5]
            logprobs[state.index(s)] += g.logprobs
        if between is not None:
            await between(engine, call)
    return [(s.token_ids, lp) for s, lp in zip(state, logprobs, strict=True)]


async def test_the_prefix_cache_feeds_only_new_tokens_and_changes_nothing(model_dir):
    """A request's next call reuses the keys of what it fed before (its chunk, the tokens an
    environment appended come after them) and makes exactly the tokens of a cache-free engine."""
    seqs = _requests(6, random.Random(8), max_new_tokens=40)
    cached, plain = TorchEngine(str(model_dir)), TorchEngine(str(model_dir), prefix_cache_mb=0)
    got = await _in_turns(cached, seqs)
    want = await _in_turns(plain, seqs)
    assert cached.prefix.hits == 3 * len(seqs) and plain.prefix is None
    for (t, lp), (t_ref, lp_ref) in zip(got, want, strict=True):
        assert t == t_ref
        assert lp == pytest.approx(lp_ref, rel=0, abs=1e-9)


async def test_a_weight_load_empties_the_prefix_cache(model_dir, tmp_path):
    """Keys and values are the weights': after a load, a continued request is fed in full under
    the new weights, as on an engine that never saw it."""
    tok = build_tokenizer(Addition().alphabet)
    save(build_model(len(tok), seed=98, hidden=64, layers=2, heads=4, mlp=128), tok, tmp_path / "v1")

    async def swap_after_first(engine, call):
        if call == 0:
            await engine.load_weights(tmp_path / "v1", version=1)

    seqs = _requests(4, random.Random(9), max_new_tokens=40)
    cached = TorchEngine(str(model_dir))
    got = await _in_turns(cached, seqs, swap_after_first)
    want = await _in_turns(TorchEngine(str(model_dir), prefix_cache_mb=0), seqs, swap_after_first)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert cached.prefix.misses == 2 * len(seqs)  # the first call, and the first after the load


def test_the_prefix_cache_keeps_within_its_budget():
    layer = (torch.zeros(2, 10, 8), torch.zeros(2, 10, 8))  # 1,280 bytes a request (float32)
    cache = PrefixCache(max_bytes=3000)
    for r in ("a", "b", "c"):
        cache.put(r, list(range(10)), [layer])
    assert len(cache) == 2 and cache.bytes <= 3000
    assert cache.take("a", list(range(11))) is None  # the least recently used went first
    assert cache.take("c", list(range(10))) is None  # not a proper prefix: dropped
    assert cache.take("b", list(range(12))) is not None and len(cache) == 0
