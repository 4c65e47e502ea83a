"""The demo's model for an environment (`rlboost run --env` without `--model-dir`): a character
model on the environment's alphabet, trained on the environment's worked solutions
(`solution(row)`) in the episode's own chat format (`ChatFormat.conversation_ids`, loss on the
assistant's tokens only) until its held-out success reaches a target (`env_warm_start`); where
it lives and whether it is built for this environment (`demo_model_dir`, `check_demo_model`,
`ensure_demo_model`). The single-turn demo's is `rlboost.trainer.bootstrap.warm_start`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from pathlib import Path
from typing import Any

from rlboost.config import EnvSettings
from rlboost.envs import load_env
from rlboost.logs import get_logger
from rlboost.trainer.data import DataError
from rlboost.trainer.episodes.data import EpisodeData
from rlboost.trainer.episodes.evaluation import greedy_episodes
from rlboost.trainer.episodes.runner import make_runner

log = get_logger(component="episodes")


# the demo's model for an environment: smaller than the single-turn demo's (episodes are ~270
# characters, not ~40, and this box's two cores are shared)
DEMO_ARCH = {"hidden": 96, "layers": 3, "heads": 4, "mlp": 256}
DEMO_ENV_CONTEXT = 512  # the demo's model for an environment: its max_position_embeddings (`env_warm_start`)


def solutions(env: Any, rows: list[dict]) -> list[list]:
    """The environment's worked conversations for `rows` (its `solution(row)`), for a warm start."""
    fn = getattr(env, "solution", None)
    if not callable(fn):
        raise DataError(f"the {getattr(env, 'name', type(env).__name__)} environment has no solution(row): "
                        "no warm start for the demo model; train a model of your own (--model-dir)")
    return [fn(r) for r in rows]


def untooled(messages: list) -> list:
    """A worked conversation without its tool turns: the opening, then the final answer at once
    (a demonstrator that answers from its head)."""
    opening = list(itertools.takewhile(lambda m: m.role != "assistant", messages))
    last = messages[-1] if messages else None
    if last is None or last.role != "assistant" or last.tool_calls or not last.content:
        raise DataError("a worked solution that does not end in a plain answer: no untooled demonstration of it "
                        "for the warm start's guessing phase (--run.bootstrap_guess_steps 0 leaves it out)")
    return opening + [last]


def env_warm_start(env_settings: EnvSettings, out_dir: Path, target: float, max_seconds: float, *, seed: int = 0,
               context: int = DEMO_ENV_CONTEXT, batch: int = 16, lr: float = 3e-3, eval_every: int = 100,
               eval_rows: int = 64, max_steps: int = 0, guess_steps: int = 0, guess_share: float = 0.8,
               **arch: int) -> dict:
    """Build the demo's character model for `[env] ref` (its alphabet: the environment's
    `alphabet`) with `context` positions and train it on the environment's worked solutions until
    the greedy held-out success reaches `target`, `max_seconds` pass or `max_steps` steps are done
    (0: no step cap; a step cap stops at the same model however loaded the box).

    Then, for `guess_steps` steps at a tenth of the rate, on demonstrations of which `guess_share`
    answer at once without the tools (`untooled`): the model keeps the skill but seldom uses it,
    as a base model that guesses where it should call a tool. Greedy, it guesses (held-out success
    near 0); sampled, about 1 - `guess_share` of its episodes call the tools and mostly succeed:
    what RL then has to teach is when the tools pay. Without this phase RL starts from a model
    that already imitates the tool use, and its gain hangs on where the warm start stopped in the
    copying transition (docs/concepts/environments.md, "Learning on this box")."""
    import torch

    from rlboost.trainer import model as M
    from rlboost.trainer.bootstrap import sft_step

    env = load_env(env_settings.ref, **env_settings.options)
    alphabet = getattr(env, "alphabet", "")
    if not alphabet:
        raise DataError(f"--env {env_settings.ref}: the environment names no alphabet: the demo's character model "
                        "cannot read it; train a model of your own (--model-dir)")
    tokenizer = M.build_tokenizer(alphabet)
    model = M.build_model(len(tokenizer), seed=seed, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                          max_positions=context, **{**DEMO_ARCH, **arch})
    runner = make_runner(env_settings, tokenizer, context, max_turn_tokens=64)
    fmt = runner.fmt
    data = EpisodeData(env, env_settings.ref, seed=seed, eval_size=eval_rows)
    held = data.eval_samples()
    tools = asyncio.run(runner.begin("tools", held[0])).tools

    guesses = random.Random(f"guess/{seed}")

    def batch_of(rows: list[dict], share: float = 0.0):
        demos = [untooled(m) if share and guesses.random() < share else m for m in solutions(env, rows)]
        convs = [fmt.conversation_ids(m, tools) for m in demos]
        width = max(len(ids) for ids, _ in convs)
        ids_t = torch.full((len(convs), width), tokenizer.pad_token_id)
        labels = torch.full((len(convs), width), -100)
        attn = torch.zeros((len(convs), width), dtype=torch.long)
        for i, (ids, mask) in enumerate(convs):
            ids_t[i, :len(ids)] = torch.tensor(ids)
            labels[i, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
            attn[i, :len(ids)] = 1
        return ids_t, attn, labels

    def success() -> tuple[float, float]:
        def gen(prompts, max_new, stops):
            return M.greedy_ids(model, prompts, max_new, stops, tokenizer.pad_token_id)
        done = asyncio.run(greedy_episodes(runner, held, gen))
        return sum(d.reward for d in done) / len(done), sum(d.tool_calls for d in done) / len(done)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    t0, step, acc, calls, loss = time.monotonic(), 0, 0.0, 0.0, float("nan")
    while True:
        step += 1
        loss = sft_step(model, optimizer, *batch_of(data.next_batch(batch)))
        elapsed = time.monotonic() - t0
        last = elapsed >= max_seconds or step == max_steps
        if step % eval_every == 0 or last:
            acc, calls = success()
            elapsed = time.monotonic() - t0
            log.info("env warm start", env=env_settings.ref, step=step, loss=round(loss, 4), eval_success=round(acc, 3),
                     tool_calls=round(calls, 2), seconds=round(elapsed, 1))
            if acc >= target or last or elapsed >= max_seconds:
                break
    tool_acc, reached = acc, acc >= target
    if guess_steps:
        if not reached:
            log.warning("env warm start below its target: the guessing phase leaves RL little to find",
                        env=env_settings.ref, eval_success=round(acc, 3), target=target)
        # a fresh optimizer: the warm start's second moments are of a converged loss, and the
        # guesses' larger gradients over them would take steps far above the rate
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr / 10, weight_decay=0.01)
        for _ in range(guess_steps):
            step += 1
            loss = sft_step(model, optimizer, *batch_of(data.next_batch(batch), guess_share))
        acc, calls = success()
        log.info("env warm start, guessing", env=env_settings.ref, step=step, loss=round(loss, 4),
                 eval_success=round(acc, 3), tool_calls=round(calls, 2), seconds=round(time.monotonic() - t0, 1))
    seconds = round(time.monotonic() - t0, 1)
    meta = {"task": f"env:{env_settings.ref}", "env": env_settings.ref, "env_options": json.dumps(env_settings.options),
            "trained": True, "eval_acc": acc, "eval_tool_calls": calls, "steps": step, "seconds": seconds,
            "tool_eval_acc": tool_acc, "guess_steps": guess_steps, "guess_share": guess_share if guess_steps else 0.0,
            "context": context, "params": sum(p.numel() for p in model.parameters())}
    M.save(model, tokenizer, out_dir, meta=meta)
    return {"out": str(out_dir), "target": target, "reached": reached, "loss": round(loss, 4), **meta}


def demo_model_dir(data_dir: str | Path, ref: str) -> Path:
    """Where the demo's model for environment `ref` lives (one per environment: its alphabet and
    warm start are the environment's)."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in ref)[:60]
    return Path(data_dir).expanduser() / f"model-env-{name}"


def check_demo_model(model_dir: Path, env: EnvSettings, guess_steps: int = 0, guess_share: float = 0.8) -> bool:
    """True if `model_dir` holds the demo's model warm-started for this environment and options,
    with this guessing phase (`env_warm_start`)."""
    from rlboost.trainer.model import read_meta

    meta = read_meta(model_dir)
    return bool(meta.get("trained")) and meta.get("env") == env.ref and \
        meta.get("env_options") == json.dumps(env.options) and \
        meta.get("guess_steps", 0) == guess_steps and meta.get("guess_share", 0.0) == (guess_share if guess_steps else 0.0)


def ensure_demo_model(env_settings: EnvSettings, model_dir: Path, target: float, seconds: float,
                      steps: int = 0, *, guess_steps: int = 0, guess_share: float = 0.8) -> dict | None:
    """The demo's model for the run's environment in `model_dir`, built and warm-started on
    first use (one thread: on a shared box more threads only wait on each other; `steps`: the
    warm start's step cap, 0 = none; `guess_*`: its guessing phase). None if it was there already."""
    import torch

    if check_demo_model(model_dir, env_settings, guess_steps, guess_share):
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return env_warm_start(env_settings, model_dir, target, seconds, max_steps=steps, guess_steps=guess_steps,
                              guess_share=guess_share)
    finally:
        torch.set_num_threads(threads)
