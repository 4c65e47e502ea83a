"""Training on episodes: environment tokens are context, never trained (no loss, no ratio, no
token count); single-turn training is bit-identical to before; an episode's result becomes a
training sample with the environment's reward."""

from __future__ import annotations

import json
import random

import pytest
import torch

from rlboost import wire
from rlboost.config import AlgorithmSettings, TrainerSettings
from rlboost.trainer.grpo import group_advantages, grpo_loss, token_logprobs, turn_advantages
from rlboost.trainer.grpo_trainer import GRPOTrainer, sample_of, trained_mask
from rlboost.trainer.model import init_model_dir
from rlboost.trainer.run import weights_sha256
from rlboost.trainer.tasks import Addition


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_model_dir(tmp_path_factory.mktemp("m") / "model", Addition(), seed=3))


def _trainer(model_dir: str, off_policy: str = "none") -> GRPOTrainer:
    return GRPOTrainer(model_dir, TrainerSettings(device="cpu", precision="fp64", lr=1e-3),
                       AlgorithmSettings(off_policy=off_policy), seed=0)


def _episode(p: int, g: int, prompt: list[int], rng: random.Random, env_logprob: float = 0.0) -> wire.RolloutResult:
    """model turn, env tokens (a tool result), model turn, env tokens, model turn."""
    turns = [[rng.randrange(2, 16) for _ in range(rng.randint(3, 6))] for _ in range(5)]
    tokens, logprobs, segments = [], [], []
    for i, t in enumerate(turns):
        env = i % 2 == 1
        segments.append(wire.Segment(len(tokens), "w", 1, 0, kind="env" if env else "model"))
        tokens += t
        logprobs += [env_logprob if env else -2.0 - 0.01 * j for j in range(len(t))]
    return wire.RolloutResult(request_id=wire.request_id(0, p, g), step=0, group=p, prompt_ids=prompt,
                              token_ids=tokens, logprobs=logprobs, segments=segments, finish_reason="stop",
                              worker_id="w", ts=0.0)


def _single(p: int, g: int, prompt: list[int], rng: random.Random, segments: list) -> wire.RolloutResult:
    toks = [rng.randrange(2, 16) for _ in range(rng.randint(3, 9))]
    return wire.RolloutResult(request_id=wire.request_id(0, p, g), step=0, group=p, prompt_ids=prompt, token_ids=toks,
                              logprobs=[-2.5 + 0.01 * i for i in range(len(toks))], segments=segments,
                              finish_reason="length", worker_id="w", ts=0.0)


def _grads(t: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.grad is not None}


def test_an_all_trainable_mask_leaves_the_loss_bit_identical():
    torch.manual_seed(0)
    logp = torch.randn(3, 7, dtype=torch.float64).clamp(max=-0.1).requires_grad_()
    behaviour = logp.detach() + 0.3 * torch.randn(3, 7, dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.float64)
    mask[1, 5:] = 0  # padding
    adv = torch.tensor([1.0, -0.5, 0.2])
    rows = [([1], [2] * 7, [], False, [], None), ([1], [2] * 5, [], False, [], [True] * 5),
            ([1], [2] * 7, [], False, [], None)]
    assert trained_mask(mask, [r[:5] + (None,) for r in rows]) is mask  # single-turn rows: the same tensor
    m2 = trained_mask(mask, rows)  # an episode whose tokens are all the model's
    assert torch.equal(m2, mask)
    for mode in ("none", "tis", "decoupled"):
        a, _ = grpo_loss(logp, behaviour, adv, mask, off_policy=mode)
        b, _ = grpo_loss(logp, behaviour, adv, m2, off_policy=mode)
        ga, = torch.autograd.grad(a, logp)
        gb, = torch.autograd.grad(b, logp)
        assert a.item() == b.item() and torch.equal(ga, gb)


def test_single_turn_results_train_bit_identically_with_or_without_model_segments(model_dir):
    """A single-turn result (no segments, or model segments only) is trained exactly as before
    episodes: same step report, same weights to the bit."""
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 16) for _ in range(5)] for _ in range(2)]
    shas, reports = [], []
    for segs in ([], [wire.Segment(0, "w", 1, 0)], [wire.Segment(0, "w", 1, 0), wire.Segment(2, "v", 1, 0)]):
        rng = random.Random(2)
        t = _trainer(model_dir)
        t.start_step(0)
        for p in range(2):
            group = [_single(p, g, prompts[p], rng, segs) for g in range(4)]
            t.add_group(p, group, [float(g % 2) for g in range(4)])
        reports.append(t.finish_step())
        shas.append(weights_sha256(t.state_dict(torch.float64)))
    assert shas[0] == shas[1] == shas[2]
    assert reports[0].loss == reports[1].loss == reports[2].loss and reports[0].tokens == reports[2].tokens


@pytest.mark.parametrize("off_policy", ["none", "tis"])
def test_environment_tokens_contribute_no_gradient(model_dir, off_policy):
    """The trainer's gradient on episodes is the hand-computed loss over model tokens only: env
    tokens (whatever behaviour logprob they carry: here one that would blow up a ratio) add
    nothing, and are not counted in the step's tokens."""
    rng = random.Random(5)
    prompt = [rng.randrange(2, 16) for _ in range(4)]
    results = [_episode(0, g, prompt, rng, env_logprob=-40.0) for g in range(4)]
    rewards = [1.0, 0.0, 0.0, 1.0]

    t = _trainer(model_dir, off_policy)
    t.start_step(0)
    t.add_group(0, results, rewards)  # fp64: ordered streaming, group 0 is back-propagated now
    got = _grads(t)

    ref = _trainer(model_dir, off_policy)
    ordered = sorted(results, key=lambda r: r.request_id)
    logp, mask = token_logprobs(ref.model, [r.prompt_ids for r in ordered], [r.token_ids for r in ordered])
    behaviour, mask = torch.zeros_like(logp), mask.clone()
    for b, r in enumerate(ordered):
        mask[b, : len(r.token_ids)] *= torch.tensor(wire.trainable_mask(r.segments, len(r.token_ids)),
                                                    dtype=mask.dtype)
        behaviour[b, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=logp.dtype)
    adv = group_advantages([rewards[results.index(r)] for r in ordered], [0] * 4)
    loss, _ = grpo_loss(logp, behaviour, adv, mask, num_tokens=1.0, off_policy=off_policy)
    loss.backward()
    want = _grads(ref)
    assert set(got) == set(want)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) < 1e-12

    # the env tokens' logprobs are never read: any value gives the same gradient
    t2 = _trainer(model_dir, off_policy)
    t2.start_step(0)
    t2.add_group(0, [msgspec_env_logprobs(r, 0.0) for r in results], rewards)
    again = _grads(t2)
    assert all(torch.equal(again[k], got[k]) for k in got)

    rep = t.finish_step()
    model_tokens = sum(sum(wire.trainable_mask(r.segments, len(r.token_ids))) for r in results)
    assert rep.tokens == model_tokens < sum(len(r.token_ids) for r in results)


def test_turn_rewards_add_each_turns_normalised_reward_to_its_tokens(model_dir):
    """An episode whose turns were rewarded trains with, per token of model turn t, the GRPO
    advantage plus coef x the turn's reward normalised over the group at t: the gradient equals
    the hand-built per-token loss; with coef 0 (or no turn rewards) it is the episode loss."""
    rng = random.Random(6)
    prompt = [rng.randrange(2, 16) for _ in range(4)]
    results = [_episode(0, g, prompt, rng) for g in range(4)]  # 3 model turns each
    rewards = [1.0, 0.0, 0.0, 1.0]
    turns = [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], None, [0.0, 1.0]]
    coef = 0.5

    t = _trainer(model_dir)
    t.alg = AlgorithmSettings(turn_reward_coef=coef)
    t.start_step(0)
    t.add_group(0, results, rewards, turns)
    got = _grads(t)

    ref = _trainer(model_dir)
    order = sorted(range(4), key=lambda i: results[i].request_id)
    ordered = [results[i] for i in order]
    logp, mask = token_logprobs(ref.model, [r.prompt_ids for r in ordered], [r.token_ids for r in ordered])
    behaviour, mask = torch.zeros_like(logp), mask.clone()
    adv = torch.zeros(logp.shape, dtype=torch.float32)  # as the trainer builds it
    episode = group_advantages([rewards[i] for i in order], [0] * 4)
    by_turn = turn_advantages([turns[i] for i in order])
    assert by_turn[order.index(2)] == []  # no turn rewards: its tokens keep the episode advantage
    for b, r in enumerate(ordered):
        mask[b, : len(r.token_ids)] *= torch.tensor(wire.trainable_mask(r.segments, len(r.token_ids)), dtype=mask.dtype)
        behaviour[b, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=logp.dtype)
        for k, turn in enumerate(wire.token_turns(r.segments, len(r.token_ids))):
            adv[b, k] = float(episode[b]) + (coef * by_turn[b][turn] if turn < len(by_turn[b]) else 0.0)
    loss, _ = grpo_loss(logp, behaviour, adv, mask, num_tokens=1.0)
    loss.backward()
    want = _grads(ref)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) < 1e-12

    plain = {}
    for coef_, turns_ in ((0.0, turns), (coef, None)):
        t2 = _trainer(model_dir)
        t2.alg = AlgorithmSettings(turn_reward_coef=coef_)
        t2.start_step(0)
        t2.add_group(0, results, rewards, turns_)
        plain[coef_] = _grads(t2)
    t3 = _trainer(model_dir)
    t3.start_step(0)
    t3.add_group(0, results, rewards)
    episode_only = _grads(t3)
    for g in plain.values():
        assert all(torch.equal(g[k], episode_only[k]) for k in g)
    assert any(not torch.equal(got[k], episode_only[k]) for k in got)


def test_turn_advantages_normalise_each_turn_over_the_episodes_that_reached_it():
    out = turn_advantages([[1.0, 0.0, 1.0], [0.0, None, 1.0], None, [1.0]])
    assert out[2] == []
    assert out[0][0] == out[3][0] > 0 > out[1][0]  # turn 0: three episodes, 1, 0, 1
    assert out[0][1] == out[1][1] == 0.0  # turn 1: 0 and a missing 0 agree: no signal
    assert out[0][2] == out[1][2] == 0.0  # turn 2: both right
    assert abs(sum(x[0] for x in out if x)) < 1e-9


def test_token_turns_count_the_environment_segments_before_each_token():
    segs = [wire.Segment(0, "w", 1, 0), wire.Segment(2, "v", 1, 0), wire.Segment(3, "w", 1, 0, kind="env"),
            wire.Segment(5, "w", 1, 0), wire.Segment(6, "w", 1, 0, kind="env"), wire.Segment(7, "w", 1, 0)]
    assert wire.token_turns(segs, 9) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # a hand-off at 2 stays in turn 0
    assert wire.token_turns([], 3) == [0, 0, 0]


def msgspec_env_logprobs(r: wire.RolloutResult, value: float) -> wire.RolloutResult:
    import msgspec

    mask = wire.trainable_mask(r.segments, len(r.token_ids))
    return msgspec.structs.replace(r, logprobs=[lp if m else value for lp, m in zip(r.logprobs, mask, strict=True)])


def test_sample_of_carries_the_trainable_mask_only_for_episodes():
    rng = random.Random(0)
    ep = _episode(0, 0, [3, 4], rng)
    s = sample_of(ep, 0)
    assert s[5] == wire.trainable_mask(ep.segments, len(ep.token_ids)) and not all(s[5])
    assert sample_of(_single(0, 0, [3], rng, []), 0)[5] is None


# ---------------------------------------------------------------- episode results -> samples


def _calc_runner(max_episode_tokens: int = 512):
    from rlboost.config import EnvSettings
    from rlboost.envs import calculator
    from rlboost.trainer.episodes.runner import make_runner
    from rlboost.trainer.model import build_tokenizer

    settings = EnvSettings(ref="calculator", options={"instructions": False}, describe_tools=False,
                           max_episode_tokens=max_episode_tokens, max_turns=6)
    return make_runner(settings, build_tokenizer(calculator.ALPHABET), 512, max_turn_tokens=48)


def _policy(runner, rows, wrong: bool = False):
    """A batch policy that solves each row (by its question in the context) one calc step per
    turn, reading nothing: `wrong` answers off by one."""
    from rlboost.envs import calculator

    fmt = runner.fmt
    by_question = {r["question"]: r for r in rows}

    def turn_text(context: str) -> str:
        row = next(r for q, r in by_question.items() if q in context)
        done = context.count("<tool_response>")
        work = calculator.work(row["steps"])
        if done < len(work):
            return f"<tool_call>calc {work[done][0]}</tool_call>"
        return f"Answer: {int(row['answer']) + int(wrong)}"

    def generate(prompts, max_new, stops):
        return [fmt.encode(turn_text(fmt.tokenizer.decode(p))) + [fmt.turn_end_id] for p in prompts]

    return generate


async def _result(runner, row, rid: str, wrong: bool = False, forged_score: bool = False) -> wire.RolloutResult:
    """What a worker's result of this episode holds: tokens after the opening, typed segments,
    behaviour logprobs (0 on env tokens) and the final state (tokens left out, as stored)."""
    from rlboost import episodes
    from rlboost.envs.protocol import Score

    gen = _policy(runner, [row], wrong)
    last = {}

    async def generate(ids, budget, stops):
        new = gen([ids], budget, stops)[0]
        return (new, [-0.25] * len(new), "stop")

    await runner.run(generate, rid, row, on_checkpoint=lambda s: last.update(snap=s))
    snap = last["snap"]
    if forged_score:
        snap.score = Score(reward=1.0)
    prompt = snap.segments[0].token_ids
    tokens, logprobs, segments = [], [], []
    for seg in snap.segments[1:]:
        segments.append(wire.Segment(len(tokens), "w", 1, 0, kind=seg.kind))
        tokens += seg.token_ids
        logprobs += seg.logprobs if seg.kind == "model" else [0.0] * len(seg.token_ids)
    state = wire.EpisodeState(turn=snap.turn, at=len(tokens), env_state=episodes.pack(snap), done=True,
                              reason=snap.end_reason)
    return wire.RolloutResult(request_id=rid, step=0, group=0, prompt_ids=prompt, token_ids=tokens,
                              logprobs=logprobs, segments=segments, finish_reason="stop", worker_id="w", ts=0.0,
                              episode=state)


async def test_an_episode_result_becomes_a_sample_scored_by_the_trainers_environment():
    from rlboost.envs import calculator
    from rlboost.trainer.episodes.scoring import EpisodeScorer, training_episode

    runner = _calc_runner()
    row = calculator.rows("train", 1, seed=4)[0]
    good = await _result(runner, row, "r-0")
    ep = await training_episode(runner, good)
    assert ep.reward == 1.0 and ep.tool_calls == len(row["steps"]) and ep.end_reason == "done"
    assert ep.prompt_ids == list(good.prompt_ids) and ep.response_ids == list(good.token_ids)
    text = runner.fmt.tokenizer.decode(ep.response_ids)
    assert "<tool_response>" in text and text.rstrip("<eos>").endswith(f"Answer: {row['answer']}")
    envs = [t for t, m in zip(ep.response_ids, ep.mask, strict=True) if not m]
    assert runner.fmt.tokenizer.decode(envs).count("<tool_response>") == len(row["steps"])  # env tokens masked
    assert [lp for lp, m in zip(ep.logprobs, ep.mask, strict=True) if m] == [-0.25] * sum(ep.mask)
    assert sample_of(good, 0)[5] == ep.mask

    # a wrong answer scores 0, and a score the worker wrote into the state is not taken
    bad = await _result(runner, row, "r-1", wrong=True, forged_score=True)
    assert (await training_episode(runner, bad)).reward == 0.0
    import msgspec
    failed = msgspec.structs.replace(good, request_id="r-2", finish_reason="error", error="engine broke", episode=None)
    scorer = EpisodeScorer(runner)
    scores = await scorer.group(row, [good, bad, failed])
    assert scores.rewards == [1.0, 0.0, 0.0]
    assert len(scores.turn_rewards) == 3 and scores.turn_rewards[2] is None  # the failed one has no turns scored
    # a step row counts the episodes that step trains, not those scored while it ran (async
    # scores the next step's groups during this one): none until trained, each once
    assert scorer.trained([]).row()["episodes"] == 0
    stats = scorer.trained([((0, 0), [good, bad]), ((0, 1), [failed])]).row()
    assert stats["episodes"] == 3 and stats["tool_calls_mean"] == round(2 * len(row["steps"]) / 3, 3)
    assert sum(stats["episode_ends"].values()) == 3
    assert scorer.trained([((0, 0), [good, bad])]).row()["episodes"] == 0  # trained once
    assert scorer.total.episodes == 3


async def test_the_episode_source_makes_each_rows_episode_requests_inside_a_running_loop():
    from rlboost.envs import calculator
    from rlboost.trainer.episodes.data import EpisodeData
    from rlboost.trainer.episodes.source import EpisodeSource

    runner = _calc_runner()
    data = EpisodeData(runner.env, "calculator", seed=3, eval_size=8)
    assert all(r["split"] == "test" for r in data.eval_samples()) and len(data.eval_samples()) == 8
    src = EpisodeSource(data, runner, run_id="rtest", seed=3, samples=2, temperature=1.0)
    reqs = await src.requests(5, 7, 3)  # in this test's event loop: no thread, no loop of its own
    assert len(reqs) == 6 and len({r.request_id for r in reqs}) == 6
    for q in reqs:
        row = src.sample((5, q.group))
        assert q.episode is not None and json.loads(q.episode.row) == row and q.episode.env == "calculator"
        assert json.loads(q.episode.config) == {"instructions": False} and q.policy_version == 7
        opening = (await runner.begin(q.request_id, row)).segments[0].token_ids
        assert q.prompt_ids == opening and len(q.prompt_ids) + q.max_new_tokens == 512
        assert row["question"] in runner.fmt.tokenizer.decode(q.prompt_ids)
    again = await EpisodeSource(EpisodeData(runner.env, "calculator", seed=3), runner, run_id="rtest", seed=3,
                                samples=2, temperature=1.0).requests(5, 7, 3)
    assert [(q.request_id, q.seed, q.prompt_ids) for q in again] == [(q.request_id, q.seed, q.prompt_ids) for q in reqs]
    assert calculator.rows("train", 1, seed=0)[0] != calculator.rows("test", 1, seed=0)[0]


async def test_greedy_episodes_play_every_row_to_its_end_in_batches():
    from rlboost.envs import calculator
    from rlboost.trainer.episodes.evaluation import greedy_episodes

    runner = _calc_runner()
    rows = calculator.rows("test", 5, seed=0)
    done = await greedy_episodes(runner, rows, _policy(runner, rows))
    assert [d.reward for d in done] == [1.0] * 5
    assert [d.tool_calls for d in done] == [len(r["steps"]) for r in rows]
    wrong = await greedy_episodes(runner, rows, _policy(runner, rows, wrong=True))
    assert [d.reward for d in wrong] == [0.0] * 5


async def test_each_held_out_evaluation_names_its_episodes_and_tool_calls_its_own():
    """A tool that de-duplicates on its idempotency key must not answer one evaluation's call
    from another's: the episode ids (and so the keys) carry the run, the life and the round."""
    from rlboost.envs import calculator
    from rlboost.trainer.episodes.evaluation import EpisodeEvaluation

    runner = _calc_runner()
    rows = calculator.rows("test", 3, seed=0)
    policy = _policy(runner, rows)

    class Ops:  # the trainer's greedy generation, as the evaluation calls it
        def call(self, what, prompts, max_new, stops, pad):
            return policy(prompts, max_new, stops)

    ids: list[str] = []
    begin = runner.begin

    async def recording(episode_id, row):
        ids.append(episode_id)
        return await begin(episode_id, row)

    runner.begin = recording
    evaluation = EpisodeEvaluation(rows, runner, Ops(), 0, run_id="r1", life="l2")
    assert (await evaluation.evaluate()).accuracy == 1.0 and (await evaluation.evaluate()).accuracy == 1.0
    assert ids == [f"r1-l2-eval{n}-{i}" for n in (1, 2) for i in range(3)]


# ---------------------------------------------------------------- rlboost run --env, end to end


@pytest.mark.slow
def test_rlboost_run_env_calculator_trains_two_steps_through_real_workers(services, tmp_path, calc_model_dir):
    """`rlboost run --env calculator --steps 2`: episode requests through real NATS / Redis, a
    torch worker process and the reserved engine, env tokens masked, rewards from the trainer's
    environment, held-out success evaluated by greedy episodes."""
    import os
    import subprocess
    import sys

    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--env", "calculator", "--model-dir",
                        str(calc_model_dir), "--run-dir", str(run_dir), "--steps", "2", "--prompts", "2",
                        "--samples", "2", "--workers", "1", "--eval-every", "1", "--eval-size", "4",
                        "--max-response-tokens", "24", "--env.max_turns", "3", "--env.describe_tools", "false",
                        "--env.options.instructions", "false", "--t-seed", "0.5", "--t-seed-floor", "0.5"],
                       capture_output=True, text=True, env=env, timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert out["steps"] == 2 and len(rows) == 2 and out["request_errors"] == 0, p.stderr[-3000:]
    for r in rows:
        assert r["episodes"] == 4 and r["eval_acc"] is not None and r["tokens"] > 0
        assert sum(r["episode_ends"].values()) == 4 and "unfinished" not in r["episode_ends"]
    assert out["eval_first"] is not None


@pytest.mark.slow
def test_rlboost_run_env_reasoning_gym_trains_two_steps_with_environment_turns(services, tmp_path,
                                                                              short_turns_model_dir):
    """An environment from an installed library through `rlboost run --env`: reasoning-gym's
    basic_arithmetic with two attempts (a wrong answer gets "not correct, try again": an
    environment turn, then a second model turn), 2 steps through real NATS / Redis and a torch
    worker process, scored by the task's own verifier on the trainer."""

    import os
    import subprocess
    import sys

    pytest.importorskip("reasoning_gym")
    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--env", "reasoning-gym", "--model-dir",
                        str(short_turns_model_dir), "--run-dir", str(run_dir), "--steps", "2", "--prompts", "2",
                        "--samples", "2", "--workers", "1", "--eval-every", "2", "--eval-size", "2",
                        "--max-response-tokens", "24", "--env.max_turns", "3", "--env.options.attempts", "2",
                        "--env.options.dataset", "basic_arithmetic", "--t-seed", "0.5", "--t-seed-floor", "0.5"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert out["steps"] == 2 and len(rows) == 2 and out["request_errors"] == 0, p.stderr[-3000:]
    for r in rows:
        assert r["episodes"] == 4 and r["tokens"] > 0 and sum(r["episode_ends"].values()) == 4
        assert "unfinished" not in r["episode_ends"] and "env_error" not in r["episode_ends"], r["episode_ends"]
    # a second model turn follows an environment turn ("try again"): most episodes had one
    assert sum(r["turns_mean"] for r in rows) / len(rows) > 1.2, [r["turns_mean"] for r in rows]


@pytest.mark.slow
def test_rlboost_run_env_on_the_environment_pool_runs_every_tool_call_there(services, tmp_path,
                                                                           tool_calling_model_dir):
    """`rlboost run --env calculator --env.inline false`: the run starts an `rlboost env-worker`
    process; every turn that ends in a tool call goes to it (a turn without one gets the
    environment's reply on the generation side) and 2 steps train on what comes back."""
    import os
    import subprocess
    import sys

    from rlboost.workers.counters import read_counters

    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--env", "calculator", "--model-dir",
                        str(tool_calling_model_dir), "--run-dir", str(run_dir), "--steps", "2", "--prompts", "2",
                        "--samples", "2", "--workers", "1", "--eval-every", "2", "--eval-size", "2",
                        "--max-response-tokens", "40", "--env.max_turns", "3", "--env.describe_tools", "false",
                        "--env.options.instructions", "false", "--t-seed", "0.5", "--t-seed-floor", "0.5",
                        "--env.inline", "false"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert out["steps"] == 2 and out["request_errors"] == 0 and all(r["episodes"] == 4 for r in rows)
    assert sum(r["tool_calls_mean"] for r in rows) > 0, [r["tool_calls_mean"] for r in rows]
    counters = {c.stem: read_counters(c) for c in (run_dir / "workers").rglob("*.counters")}
    env_side = {k: c for k, c in counters.items() if k.startswith("l0e")}
    sent = sum(c["to_env_pool"] for k, c in counters.items() if k not in env_side)
    assert env_side and sent == sum(c["tool_phases"] for c in env_side.values()) > 0, counters
    assert sum(c["tool_calls"] for c in env_side.values()) >= sent
    assert sum(c["env_tokens"] for c in env_side.values()) > 0  # the tool results were written there


def test_a_saved_character_tokenizer_loads_with_its_spaces_and_newlines(calc_model_dir):
    """The demo's character model beside a Qwen2 config.json: AutoTokenizer would rebuild it as
    Qwen2's byte-level tokenizer, which drops the calculator's spaces and newlines."""
    from rlboost.envs import calculator
    from rlboost.modeldir import load_tokenizer
    from rlboost.trainer.model import build_tokenizer

    text = "Max has 38 beads.\n<tool_call>calc 53*8</tool_call><eos><tool_response>424</tool_response>\n"
    loaded, built = load_tokenizer(calc_model_dir), build_tokenizer(calculator.ALPHABET)
    assert loaded(text, add_special_tokens=True)["input_ids"] == built(text, add_special_tokens=True)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text


def test_worker_processes_get_the_runs_env_settings():
    from rlboost.config import EnvSettings, load_settings
    from rlboost.trainer.episodes.runner import worker_env

    env = EnvSettings(ref="calculator", options={"instructions": False}, describe_tools=False, max_turns=3,
                      tool_timeout_s=2.5)
    got = load_settings(None, environ=worker_env(env)).env
    assert got == EnvSettings(ref="calculator", describe_tools=False, tool_timeout_s=2.5)
    # an episode's turn bound travels in its request (`EpisodeSpec.max_turns`), not the environment
    assert "RLBOOST_ENV__MAX_TURNS" not in worker_env(env)
    assert worker_env(EnvSettings()) == {}


def test_an_untooled_demonstration_is_the_opening_then_the_answer_at_once():
    """The guessing phase's demonstrations: a worked solution without its tool turns."""
    from rlboost.envs import calculator
    from rlboost.trainer.data import DataError
    from rlboost.trainer.episodes.warm_start import untooled

    row = calculator.rows("train", 1, level="small")[0]
    worked = calculator.solution(row, instructions=False)
    assert sum(1 for m in worked if m.tool_calls) >= 2
    got = untooled(worked)
    assert [m.role for m in got] == ["user", "assistant"] and not any(m.tool_calls for m in got)
    assert got[0] == worked[0] and got[-1].content == f"Answer: {row['answer']}"
    with pytest.raises(DataError, match="plain answer"):
        untooled(worked[:-2])  # ends in a tool turn


def test_the_guessing_phase_runs_after_the_warm_start_and_names_the_model_it_built(tmp_path):
    """`run.bootstrap_guess_steps`: more steps after the warm start (its own model, recorded in
    the meta), and a demo model built with another guessing phase is not taken for this one."""
    from rlboost.config import EnvSettings, RunSettings
    from rlboost.trainer.episodes.warm_start import check_demo_model, env_warm_start
    from rlboost.trainer.model import read_meta

    env = EnvSettings(ref="calculator", describe_tools=False, options={"instructions": False, "level": "small"})
    tiny = dict(hidden=32, layers=1, heads=2, mlp=64, batch=2, eval_rows=2, eval_every=100)
    plain = env_warm_start(env, tmp_path / "plain", target=1.0, max_seconds=600, max_steps=3, **tiny)
    out = env_warm_start(env, tmp_path / "guess", target=1.0, max_seconds=600, max_steps=3, guess_steps=2,
                         guess_share=0.5, **tiny)
    assert plain["steps"] == 3 and out["steps"] == 5 and out["guess_steps"] == 2
    assert out["tool_eval_acc"] == plain["eval_acc"]  # the same warm start before the guesses
    a, b = (open(tmp_path / d / "model.safetensors", "rb").read() for d in ("plain", "guess"))
    assert a != b
    meta = read_meta(tmp_path / "guess")
    assert (meta["guess_steps"], meta["guess_share"]) == (2, 0.5)
    assert check_demo_model(tmp_path / "guess", env, 2, 0.5) and check_demo_model(tmp_path / "plain", env)
    assert not check_demo_model(tmp_path / "guess", env) and not check_demo_model(tmp_path / "guess", env, 2, 0.8)
    assert not check_demo_model(tmp_path / "plain", env, 200, 0.8)
    for bad in (dict(bootstrap_guess_steps=-1), dict(bootstrap_guess_share=1.0), dict(bootstrap_guess_share=-0.1)):
        with pytest.raises(Exception, match="run.bootstrap_guess"):
            RunSettings(**bad)


def test_the_env_warm_start_stops_at_its_step_cap_with_the_same_model_every_time(tmp_path):
    """`run.bootstrap_steps`: a warm start that stops at a step, not a time, builds the same
    model on a loaded box as on an idle one (the documented calculator runs start from one)."""
    from rlboost.config import EnvSettings, RunSettings
    from rlboost.trainer.episodes.warm_start import check_demo_model, env_warm_start
    from rlboost.trainer.model import read_meta

    env = EnvSettings(ref="calculator", describe_tools=False, options={"instructions": False, "level": "small"})
    tiny = dict(hidden=32, layers=1, heads=2, mlp=64, batch=2, eval_rows=2, eval_every=100)
    outs = [env_warm_start(env, tmp_path / f"m{i}", target=1.0, max_seconds=600, max_steps=3, **tiny) for i in range(2)]
    assert [o["steps"] for o in outs] == [3, 3] and not outs[0]["reached"]
    assert check_demo_model(tmp_path / "m0", env) and read_meta(tmp_path / "m0")["steps"] == 3
    a, b = (open(tmp_path / f"m{i}" / "model.safetensors", "rb").read() for i in range(2))
    assert a == b
    with pytest.raises(Exception, match="run.bootstrap_steps"):
        RunSettings(bootstrap_steps=-1)


def test_the_calculator_example_config_is_the_measured_command_line():
    """`examples/calculator.toml` (the README's agentic first run) holds the settings of the
    command line that docs/concepts/environments.md measured, flag for flag."""
    import re
    import shlex
    from pathlib import Path

    import msgspec

    from rlboost.config import load_settings
    from rlboost.trainer.command import parse

    root = Path(__file__).resolve().parents[1]
    blocks = re.findall(r"```sh\n(.*?)```", (root / "docs/concepts/environments.md").read_text(), re.S)
    measured = [b for b in blocks if "--run.bootstrap_target 0.6" in b]
    assert len(measured) == 1
    argv = shlex.split(measured[0].replace("\\\n", " "))
    assert argv[:2] == ["rlboost", "run"]
    from_flags = parse(argv[2:]).settings
    from_file = parse([], s=load_settings(root / "examples/calculator.toml")).settings
    assert msgspec.to_builtins(from_file) == msgspec.to_builtins(from_flags)
    assert from_file.env.ref == "calculator" and from_file.rollout.mode == "async" and from_file.run.policy == "hybrid"
