"""The greedy held-out evaluation stays inside the model's context (issue 40): a model with
learned absolute positions (GPT-2 style: one embedding per position, none past
`max_position_embeddings`) fails with an IndexError on any sequence longer than its context,
so a left-padded batch of episodes must never generate past it, whatever its rows' lengths.
The model is built here, tiny and untrained, in Hugging Face layout (no download)."""

from __future__ import annotations

import pytest

from rlboost.config import AlgorithmSettings, EnvSettings, TrainerSettings
from rlboost.envs.calculator import ALPHABET
from rlboost.envs.protocol import Env, Opening, Score, user

CONTEXT = 96


@pytest.fixture(scope="module")
def gpt2_model_dir(tmp_path_factory):
    """A GPT-2-style model (learned absolute positions) with a 96-token context, on the
    calculator's character tokenizer, saved as a user's model folder is."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlboost.trainer.model import build_tokenizer, save

    tok = build_tokenizer(ALPHABET)
    config = GPT2Config(vocab_size=len(tok), n_positions=CONTEXT, n_embd=32, n_layer=1, n_head=2,
                        pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # it never ends a turn: every turn runs to its budget, the longest sequences there are
        model.transformer.wte.weight[tok.eos_token_id] = -10 * model.transformer.wte.weight.abs().max()
    return save(model, tok, tmp_path_factory.mktemp("m") / "gpt2", meta={"trained": True})


class Echo(Env):
    """One model turn answering `row["q"]`; the reward says nothing (only the lengths matter here)."""

    def start(self, row, ctx):
        return Opening(messages=[user(row["q"])], tools=[], state={})

    def score(self, transcript, state, ctx):
        return Score(reward=1.0)


async def test_greedy_episodes_of_a_gpt2_model_stay_inside_its_context(gpt2_model_dir):
    """Rows of very different lengths in one batch: a long opening whose turn the context cuts
    short beside short ones with the whole turn budget. Generating the batch for its largest
    budget took the long row past position 96 (IndexError: index out of range in self)."""
    from rlboost.envs.chat import chat_format
    from rlboost.episodes.runner import EpisodeRunner
    from rlboost.trainer import distributed
    from rlboost.trainer.episodes.evaluation import EpisodeEvaluation, greedy_episodes
    from rlboost.trainer.grpo_trainer import GRPOTrainer
    from rlboost.trainer.model import pad_id

    trainer = GRPOTrainer(str(gpt2_model_dir), TrainerSettings(device="cpu", precision="fp32"), AlgorithmSettings(),
                          seed=0)
    fmt = chat_format(trainer.tokenizer, describe_tools=False)
    runner = EpisodeRunner(Echo(), fmt, EnvSettings(max_turns=2, max_episode_tokens=CONTEXT), max_turn_tokens=40)
    rows = [{"q": "x" * n} for n in (60, 2, 45, 5)]
    lengths = [len((await runner.begin("l", r)).token_ids) for r in rows]
    assert lengths[0] + 40 > CONTEXT > lengths[1] + 40  # the long row's turn is cut by the context, not the turn
    ops = distributed.Lockstep(trainer, trainer.ranks)
    evaluation = EpisodeEvaluation(rows, runner, ops, pad_id(trainer.tokenizer, list(fmt.stop_ids)))
    evaluated = await evaluation.evaluate()
    assert evaluated.accuracy == 1.0 and evaluated.fields["eval_tool_calls"] == 0.0

    def generate(prompts, max_new, stops):
        assert max(map(len, prompts)) + max_new <= CONTEXT  # the left-padded batch, generated to max_new
        return ops.call("greedy", prompts, max_new, stops, evaluation.pad)

    done = await greedy_episodes(runner, rows, generate)
    # every turn ran to its budget (the model never stops): the whole context, or the turn's 40 tokens
    assert [len(d.token_ids) for d in done] == [min(CONTEXT, n + 40) for n in lengths]
    assert [d.end_reason for d in done] == ["max_episode_tokens", "length", "length", "length"]
