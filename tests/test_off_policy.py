"""Off-policy correction (algorithm.off_policy): truncated IS (verl) and decoupled PPO (AReaL)
from the engines' recorded logprobs, per token, with each token's policy version from its
result's segments; and the ratio and staleness statistics on every step's row."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from rlboost import metrics, wire
from rlboost.config import AlgorithmSettings, ConfigError, TrainerSettings, load_settings
from rlboost.trainer.grpo import grpo_loss, token_logprobs
from rlboost.trainer.grpo_trainer import GRPOTrainer
from rlboost.trainer.loggers import scalars
from rlboost.trainer.model import init_model_dir
from rlboost.trainer.report import RunReport
from rlboost.trainer.tasks import get_task

torch.set_num_threads(1)


def _case(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g, dtype=dtype) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=dtype)
    adv = torch.tensor([1.5, -0.5, -1.0], dtype=dtype)
    ent = torch.rand(3, 5, generator=g, dtype=dtype)
    ref = logp - 0.1
    return logp * mask, mask, adv, ent, ref


def _run(logp, behaviour, adv, mask, mode, **kw):
    x = logp.clone().requires_grad_(True)
    loss, stats = grpo_loss(x, behaviour, adv, mask, 0.2, off_policy=mode, **kw)
    loss.backward()
    return loss.detach(), x.grad, stats


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_with_the_trainers_own_logprobs_as_behaviour_each_correction_is_the_plain_loss_exactly(mode, dtype):
    logp, mask, adv, ent, ref = _case(dtype)
    kw = {"num_tokens": 10.0, "entropy": ent, "entropy_coef": 0.01, "ref_logprobs": ref, "kl_coef": 0.05}
    plain, plain_grad, _ = _run(logp, logp, adv, mask, "none", **kw)
    loss, grad, stats = _run(logp, logp, adv, mask, mode, **kw)
    assert torch.equal(loss, plain) and torch.equal(grad, plain_grad)
    assert stats.is_ratio_mean == 1.0 and stats.is_ratio_max == 1.0 and stats.is_capped_fraction == 0.0


@pytest.mark.parametrize("mode,weights", [("tis", [0.5, 1.0, 2.0, 2.0]), ("decoupled", [0.5, 1.0, 0.0, 0.0])])
def test_a_large_ratio_is_truncated_by_tis_and_dropped_by_decoupled(mode, weights):
    pi_old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
    raw = [0.5, 1.0, 3.0, math.exp(5)]  # pi_old / mu per token
    mu = pi_old - torch.log(torch.tensor([raw], dtype=torch.float64))
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, grad, stats = _run(pi_old, mu, torch.tensor([1.0], dtype=torch.float64), mask, mode, is_cap=2.0)
    # the clip is around pi_old (ratio 1, never binding): d loss / d logp_i = -A * w_i / tokens
    assert grad[0].tolist() == pytest.approx([-w / 4 for w in weights])
    assert loss.item() == pytest.approx(-sum(weights) / 4)
    assert stats.is_ratio_max == pytest.approx(math.exp(5)) and stats.is_ratio_mean == pytest.approx(sum(raw) / 4)
    assert stats.is_capped_fraction == 0.5 and stats.clip_fraction == 0.0 and stats.ratio_mean == 1.0


def test_plain_mode_keeps_clipping_around_the_behaviour_and_only_reports_the_ratios():
    pi_old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    mu = pi_old - torch.log(torch.tensor([[3.0, 1.0]], dtype=torch.float64))
    _, grad, stats = _run(pi_old, mu, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
                          "none", is_cap=2.0)
    assert grad[0].tolist() == pytest.approx([0.0, -0.5])  # ratio 3 > 1 + eps with A > 0: clipped, no gradient
    assert stats.clip_fraction == 0.5 and stats.is_capped_fraction == 0.5 and stats.is_ratio_max == pytest.approx(3.0)


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_a_behaviour_logprob_that_is_not_a_number_weighs_nothing_and_poisons_nothing(mode):
    pi_old = torch.tensor([[-1.0, -2.0, -1.5]], dtype=torch.float64)
    mu = torch.tensor([[-1.0, float("nan"), float("-inf")]], dtype=torch.float64)
    one = torch.tensor([1.0], dtype=torch.float64)
    loss, grad, stats = _run(pi_old, mu, one, torch.ones(1, 3, dtype=torch.float64), mode, is_cap=2.0)
    inf_weight = 2.0 if mode == "tis" else 0.0  # mu = -inf: ratio +inf, truncated to the cap or dropped
    assert grad[0].tolist() == pytest.approx([-1 / 3, 0.0, -inf_weight / 3]) and math.isfinite(loss.item())
    assert stats.is_capped_fraction == pytest.approx(2 / 3)


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_uncapped_correction_estimates_the_on_policy_gradient_from_a_stale_policys_samples(mode):
    """A bandit: a softmax policy pi over 6 actions, samples drawn from an older policy mu.
    The true gradient of E_pi[r] is pi * (r - E_pi[r]); weighted by pi/mu, the stale samples
    estimate it (up to sampling noise); the plain loss, clipping around mu, does not."""
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(6, generator=g, dtype=torch.float64)
    pi, mu = torch.softmax(theta, 0), torch.softmax(theta + torch.randn(6, generator=g, dtype=torch.float64), 0)
    r = torch.rand(6, generator=g, dtype=torch.float64)
    true = pi * (r - (pi * r).sum())
    a = torch.multinomial(mu, 20000, replacement=True, generator=g)

    def error(off_policy: str) -> float:
        th = theta.clone().requires_grad_(True)
        loss, _ = grpo_loss(torch.log_softmax(th, 0)[a][:, None], torch.log(mu)[a][:, None], r[a],
                            torch.ones(len(a), 1, dtype=torch.float64), 0.2, off_policy=off_policy, is_cap=1e9)
        loss.backward()
        return float((-th.grad - true).norm() / true.norm())

    assert error(mode) < 0.2 and error("none") > 0.5  # measured: 0.087 and 1.32


def test_token_versions_expand_segments_whatever_order_and_junk_they_come_in():
    S = wire.Segment
    assert wire.token_versions([], 3) == [-1, -1, -1]
    assert wire.token_versions([S(0, "a", 1, 4), S(3, "b", 2, 6)], 5) == [4, 4, 4, 6, 6]
    assert wire.token_versions([S(3, "b", 2, 6), S(0, "a", 1, 4)], 5) == [4, 4, 4, 6, 6]  # unsorted
    assert wire.token_versions([S(2, "a", 1, 4)], 4) == [-1, -1, 4, 4]  # before the first offset: unknown
    assert wire.token_versions([S(0, "a", 1, 4), S(2, "a", 2, 5), S(2, "b", 3, 7)], 4) == [4, 4, 7, 7]  # later claim
    assert wire.token_versions([S(-5, "a", 1, 2), S(9, "b", 2, 3), S(1, "c", 3, -2)], 3) == [2, -1, -1]


# ---------------------------------------------------------------- through the trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_model_dir(tmp_path_factory.mktemp("m") / "model", get_task("addition"), seed=1,
                              hidden=64, layers=2, heads=2, mlp=128))


def _trainer(model_dir: str, mode: str = "none", cap: float = 2.0) -> GRPOTrainer:
    return GRPOTrainer(model_dir, TrainerSettings(device="cpu", precision="fp64", lr=1e-3),
                       AlgorithmSettings(off_policy=mode, is_cap=cap), seed=0)


def _responses(n_prompts: int = 3, samples: int = 4):
    rng = random.Random(7)
    out = []
    for p in range(n_prompts):
        prompt = [rng.randrange(2, 16) for _ in range(5)]
        out += [(p, g, prompt, [rng.randrange(2, 16) for _ in range(rng.randint(4, 8))]) for g in range(samples)]
    return out


def _pi_old(model_dir: str, rows) -> list[list[float]]:
    """Each response token's logprob under the untrained policy: the trainer's pi_old."""
    t = _trainer(model_dir)
    with torch.no_grad():
        logp, _ = token_logprobs(t.model, [r[2] for r in rows], [r[3] for r in rows])
    return [logp[i, : len(r[3])].tolist() for i, r in enumerate(rows)]


def _train(model_dir, rows, logprobs, segments, mode, version=5, cap=2.0):
    t = _trainer(model_dir, mode, cap)
    t.start_step(0, policy_version=version)
    results = [wire.RolloutResult(request_id=wire.request_id(0, p, g), step=0, group=p, prompt_ids=prompt,
                                  token_ids=toks, logprobs=lp, segments=seg, finish_reason="stop", worker_id="w",
                                  ts=0.0)
               for (p, g, prompt, toks), lp, seg in zip(rows, logprobs, segments, strict=True)]
    for p in sorted({r.group for r in results}):
        group = [r for r in results if r.group == p]
        t.add_group(p, group, [float(i % 2) for i in range(len(group))])
    return t, t.finish_step()


def test_behaviour_equal_to_the_trainers_policy_trains_like_the_plain_loss(model_dir):
    rows = _responses()
    pi_old = _pi_old(model_dir, rows)
    segs = [[wire.Segment(0, "w", 1, 5)]] * len(rows)
    plain, _ = _train(model_dir, rows, pi_old, segs, "none")
    for mode in ("tis", "decoupled"):
        t, rep = _train(model_dir, rows, pi_old, segs, mode)
        a, b = plain.state_dict(torch.float64), t.state_dict(torch.float64)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-12, mode
        assert rep.is_ratio_mean == pytest.approx(1.0, abs=1e-9) and rep.is_capped == 0.0
        assert rep.staleness_mean == 0.0 and rep.staleness_max == 0


def test_stale_segments_get_their_ratio_from_their_own_behaviour_logprobs_and_the_stats_are_logged(
        model_dir, tmp_path, capsys):
    """Each response's first half was sampled two versions back with mu = pi_old - log 3 (ratio
    3, over the cap), its second half by the trained version with mu = pi_old (ratio 1)."""
    rows = _responses()
    pi_old = _pi_old(model_dir, rows)
    half = [len(r[3]) // 2 for r in rows]
    mu = [[x - (math.log(3.0) if i < h else 0.0) for i, x in enumerate(lp)] for lp, h in zip(pi_old, half, strict=True)]
    segs = [[wire.Segment(0, "old", 1, 3), wire.Segment(h, "new", 2, 5)] for h in half]
    n, stale = sum(len(r[3]) for r in rows), sum(half)
    _, rep = _train(model_dir, rows, mu, segs, "tis", version=5)
    assert rep.is_ratio_mean == pytest.approx((3 * stale + (n - stale)) / n, rel=1e-9)
    assert rep.is_ratio_max == pytest.approx(3.0, rel=1e-9) and rep.is_capped == pytest.approx(stale / n)
    assert rep.staleness_mean == pytest.approx(2 * stale / n) and rep.staleness_max == 2

    row = {"step": 0, **rep.off_policy_row()}
    assert row["off_policy"] == "tis" and row["staleness_max"] == 2
    assert {"train/is_ratio_mean", "train/is_ratio_max", "train/is_capped", "train/staleness_mean",
            "train/staleness_max"} <= set(scalars(row))
    metrics.observe_training(row)
    assert metrics.REGISTRY.get_sample_value("rlboost_trainer_staleness_versions", {"stat": "max"}) == 2
    assert metrics.REGISTRY.get_sample_value("rlboost_trainer_is_capped_fraction") == pytest.approx(stale / n, rel=1e-5)
    report = RunReport(tmp_path, 1)
    report.step(row)
    report.metrics.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["is_ratio_max"] == pytest.approx(3.0)
    line = capsys.readouterr().err
    assert f"stale={row['staleness_mean']}" in line and f"IS>cap={row['is_capped']}" in line


def test_a_ratio_that_is_not_finite_leaves_the_row_json(model_dir):
    rows = _responses(1, 2)
    mu = [[float("-inf")] + [-2.0] * (len(r[3]) - 1) for r in rows]
    _, rep = _train(model_dir, rows, mu, [[]] * len(rows), "tis")
    row = rep.off_policy_row()
    assert row["is_ratio_max"] is None and row["staleness_mean"] is None and row["staleness_max"] is None
    json.dumps(row, allow_nan=False)


def test_the_settings_refuse_an_unknown_mode_or_a_cap_of_one():
    with pytest.raises(ConfigError, match="algorithm.off_policy"):
        load_settings(None, environ={"RLBOOST_ALGORITHM__OFF_POLICY": "vtrace"})
    with pytest.raises(ConfigError, match="algorithm.is_cap"):
        load_settings(None, environ={"RLBOOST_ALGORITHM__IS_CAP": "1"})
    s = load_settings(None, environ={"RLBOOST_ALGORITHM__OFF_POLICY": "decoupled", "RLBOOST_ALGORITHM__IS_CAP": "5"})
    assert (s.algorithm.off_policy, s.algorithm.is_cap) == ("decoupled", 5.0)
    assert load_settings(None, environ={}).algorithm.off_policy == "none"  # the default: today's loss
