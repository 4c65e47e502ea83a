"""`rlboost run` (and `rlboost demo`): RL training with rollout offloaded to preemptible workers.

This module is the command: the command line read into the settings tree and checked before
anything slow starts, the model it runs on, and the launch (this process, or torchrun ranks for
`--nproc N`). The run itself (parts wired in `setup`, driven by `main_loop`) is `rlboost.trainer.run`.

Settings: the whole tree (`rlboost.config`); the flags below are shorthands for its keys and
any `--section.key value` / `section.key=value` overrides one. The effective settings are
written to `<run_dir>/settings.toml`. Checkpoints every `run.checkpoint_every` steps and at the
end (`rlboost.trainer.training_checkpoint`); `--resume RUN_DIR` continues that run: same run id, the step after
its last checkpoint, the data position restored (`rlboost.trainer.resume`, docs/guides/resume.md).
Under torchrun (`--nproc N`) rank 0 runs the training; other ranks follow (`rlboost.trainer.distributed`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch

from rlboost.config import ConfigError, EnvSettings, RunSettings, Settings, apply_overrides, dump_toml, load_settings, \
    parse_overrides
from rlboost.errors import RunLeaseError
from rlboost.logs import configure_logging, print_result
from rlboost.modeldir import ModelDirError, check_model_dir
from rlboost.services import running_services
from rlboost.trainer import distributed
from rlboost.trainer.data import DataError, FileData, PromptBudget, encode_prompt
from rlboost.envs import load_env
from rlboost.trainer.data_task import make_data, read_data
from rlboost.trainer.episodes.warm_start import DEMO_ENV_CONTEXT, demo_model_dir, ensure_demo_model
from rlboost.trainer.episodes.data import make_episode_data
from rlboost.trainer.episodes.runner import max_turn_tokens
from rlboost.trainer.episodes.source import check_openings
from rlboost.trainer.local_fleet import parse_chaos
from rlboost.trainer.model import DEMO_CONTEXT, META_FILE, build_tokenizer, load_tokenizer, read_meta
from rlboost.trainer.rewards import RewardError, load_function
from rlboost.trainer.run import Invocation, follow, train
from rlboost.trainer.tasks import get_task
from rlboost.workers.engines import EngineError

PREFLIGHT_SAMPLES = 1024  # training prompts a preflight tokenises (as many as the run drops before refusing)


def preflight(inv: Invocation, s: Settings | None = None) -> tuple:
    """Every flag, file and setting checked before anything slow starts (the demo model's build
    and warm start, the servers, the workers): a one-line RlboostError now, not minutes in. The
    data, the reward function, the model folder and its tokenizer (the demo's, before it is
    built), the token budget against the model's context, and that some training prompts fit it
    (with `--env`: that some row's opening, tools and all, leaves the model room to write).
    Returns the data it read (`make_data`'s answer), for the run to take (not read twice).
    `s`: where the demo's model lives (`services.data_dir`; default: the run's own settings)."""
    rs, ds = inv.settings.run, inv.settings.data
    s = s or inv.settings
    if inv.resume and not (Path(rs.run_dir) / "run.json").exists():
        raise ConfigError(f"--resume {rs.run_dir}: no run.json there (not a run folder)")
    if inv.settings.harness.command:  # `--harness`: rows to start sessions from; the harness reports rewards
        if rs.policy == "colocated":
            raise ConfigError("--harness with --policy colocated: a harness's calls go to the preemptible pool, which "
                              "a colocated run does not serve; use hybrid or disaggregated (with --workers)")
        if rs.model_dir and not rs.init_model:
            check_model_dir(rs.model_dir)
        return read_data(inv.settings)
    if inv.settings.env.ref:  # `--env`: the environment loads and has rows (its own or --data's); no reward function
        data = make_episode_data(inv.settings.env, ds, rs.seed)
        model = episode_model(rs, s, inv.settings.env)
        if model is not None:  # and some row's opening leaves the model room to write, in its chat format
            check_openings(inv.settings.env, data, *model, max_turn_tokens(ds))
        return data, "", 0
    data, reward, task_tokens = make_data(ds, rs.seed)
    load_function(reward)  # RewardError: a spec that names no usable function
    if rs.model_dir and not rs.init_model:
        context, tokenizer = check_model_dir(rs.model_dir).max_context, load_tokenizer(rs.model_dir)
    else:  # the demo's model: its folder if built, else what it will be built as
        model_dir = Path(rs.model_dir or Path(s.services.data_dir).expanduser() / "model").expanduser()
        if (model_dir / "config.json").exists() and (model_dir / META_FILE).exists():
            context, tokenizer = check_model_dir(model_dir).max_context, load_tokenizer(model_dir)
        else:
            context, tokenizer = DEMO_CONTEXT, build_tokenizer(get_task("addition").alphabet)
    budget = PromptBudget.for_model(ds.max_prompt_tokens, ds.max_response_tokens, context, task_tokens)
    if isinstance(data, FileData):
        samples = data.iterator.samples[:PREFLIGHT_SAMPLES]
        budget.check_samples(samples, lambda smp: encode_prompt(tokenizer, smp),
                             f"{'first ' if len(data.iterator.samples) > len(samples) else ''}training prompts")
    return data, reward, task_tokens


def episode_model(rs: RunSettings, s: Settings, env: EnvSettings) -> tuple | None:
    """(tokenizer, context) of the model a run on episodes will use, without building it: the
    user's `--model-dir`; the demo's model for the environment if built, else what it will be
    built as (the environment's alphabet); None where that cannot be known yet (an environment
    without an alphabet: the warm start refuses it with its own line)."""
    if rs.model_dir and not rs.init_model:
        return load_tokenizer(rs.model_dir), check_model_dir(rs.model_dir).max_context
    model_dir = Path(rs.model_dir).expanduser() if rs.model_dir else demo_model_dir(s.services.data_dir, env.ref)
    if (model_dir / "config.json").exists() and (model_dir / META_FILE).exists():
        return load_tokenizer(model_dir), check_model_dir(model_dir).max_context
    alphabet = getattr(load_env(env.ref, **env.options), "alphabet", "")
    return (build_tokenizer(alphabet), DEMO_ENV_CONTEXT) if alphabet else None


def resolve_model(rs: RunSettings, s: Settings, env: EnvSettings | None = None) -> str:
    """A user's `--model-dir` is checked and used as it is: read, never written. Without one
    (or with `--init-model`, for a folder of rlboost's own such as a container volume), the
    demo's model, built and warm-started on first use. `rs`: the run's section; `s`: where the
    demo's model lives (`services.data_dir`) and how to log its build. `env`: a run on episodes
    (`--env`) gets the demo's model for that environment (trainer/episodes/warm_start.py)."""
    if rs.model_dir and not rs.init_model:
        return str(check_model_dir(rs.model_dir).path)
    if env is not None and env.ref:
        model_dir = Path(rs.model_dir).expanduser() if rs.model_dir else demo_model_dir(s.services.data_dir, env.ref)
        if model_dir.exists() and any(model_dir.iterdir()) and not (model_dir / META_FILE).exists():
            raise ModelDirError(f"{model_dir} holds files that rlboost did not make: not building the demo model there")
        print(f"the demo model for --env {env.ref} in {model_dir} (build + warm start on first use)...", flush=True)
        configure_logging(json=s.log_json, level="info")  # its progress lines
        try:
            out = ensure_demo_model(env, model_dir, rs.bootstrap_target, rs.bootstrap_seconds, rs.bootstrap_steps,
                                    guess_steps=rs.bootstrap_guess_steps, guess_share=rs.bootstrap_guess_share)
        finally:
            configure_logging(json=s.log_json, level=os.environ.get("RLBOOST_LOG_LEVEL", "warning"))
        if out and out["guess_steps"]:
            print(f"model ready after {out['seconds']} s: held-out success {out['tool_eval_acc']:.3f} imitating the "
                  f"tool use, {out['eval_acc']:.3f} after {out['guess_steps']} steps of guessing (RL's to win back)",
                  flush=True)
        elif out:
            print(f"model ready: held-out success {out['eval_acc']:.3f} after {out['seconds']} s", flush=True)
        return str(model_dir)
    model_dir = Path(rs.model_dir or Path(s.services.data_dir).expanduser() / "model").expanduser()
    if model_dir.exists() and any(model_dir.iterdir()) and not (model_dir / META_FILE).exists():
        raise ModelDirError(f"{model_dir} holds files that rlboost init-model did not make: "
                            "not building the demo model there")
    if not (model_dir / "config.json").exists() or not read_meta(model_dir).get("trained"):
        from rlboost.trainer.bootstrap import warm_start

        print(f"bootstrapping the model into {model_dir} (build + supervised warm start)...", flush=True)
        threads = torch.get_num_threads()
        # One thread: with the cores shared (other jobs, a CPU hog) two OpenMP threads ran a step
        # of this ~1M-parameter model 5-7x slower than one (2.1-4.5 s against 0.44-0.62 s), and
        # the warm start hit its time cap at step 112 of the ~400 it needs
        torch.set_num_threads(1)
        configure_logging(json=s.log_json, level="info")  # its progress lines
        try:
            out = warm_start(get_task("addition"), model_dir, rs.bootstrap_target, rs.bootstrap_seconds, seed=0)
        finally:
            torch.set_num_threads(threads)
            configure_logging(json=s.log_json, level=os.environ.get("RLBOOST_LOG_LEVEL", "warning"))
        print(f"model ready: held-out greedy accuracy {out['eval_acc']:.3f} after {out['seconds']} s", flush=True)
    return str(model_dir)




def _chaos_flag(v: str) -> str:
    try:
        parse_chaos(v)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return v


# `rlboost run` flags: shorthands for settings keys (any key: --section.key VALUE or section.key=VALUE)
FLAGS = {"policy": "run.policy", "steps": "run.steps", "max_minutes": "run.max_minutes", "prompts": "rollout.prompts",
         "samples": "rollout.samples", "workers": "run.workers", "slots": "rollout.slots", "lr": "trainer.lr",
         "seed": "run.seed", "eval_every": "run.eval_every", "t_seed": "rollout.t_seed",
         "t_seed_floor": "rollout.t_seed_floor", "mode": "rollout.mode", "max_staleness": "rollout.max_staleness", "shuffle_rewards": "run.shuffle_rewards", "chaos": "run.chaos",
         "save_rollouts": "run.save_rollouts", "model_dir": "run.model_dir", "init_model": "run.init_model",
         "run_dir": "run.run_dir", "nproc": "run.nproc", "precision": "trainer.precision", "device": "trainer.device",
         "task": "data.task", "data": "data.train", "eval_data": "data.eval", "reward": "data.reward",
         "max_prompt_tokens": "data.max_prompt_tokens", "max_response_tokens": "data.max_response_tokens",
         "eval_size": "data.eval_size", "epochs": "data.epochs", "reward_timeout": "data.reward_timeout_s",
         "env": "env.ref", "harness": "harness.command"}


DEMO_STEPS = 20  # from the warm start's 0.44, GRPO reached 0.71 by step 15 and 0.75 by step 20


def parse(argv: list[str], demo: bool = False, s: Settings | None = None) -> Invocation:
    """The command line on top of the settings tree `s` (defaults < TOML < environment < this)."""
    s = s or Settings()
    p = argparse.ArgumentParser(prog="rlboost demo" if demo else "rlboost run", description=__doc__.splitlines()[0],
                                epilog="Any setting: --section.key VALUE or section.key=VALUE (e.g. --trainer.lr 1e-5).")
    p.add_argument("--policy", choices=["hybrid", "colocated", "disaggregated"])
    p.add_argument("--steps", type=int)
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--prompts", type=int)
    p.add_argument("--samples", type=int)
    p.add_argument("--workers", type=int, help="preemptible worker processes to start")
    p.add_argument("--slots", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--t-seed", type=float, help="initial seeding window (s)")
    p.add_argument("--t-seed-floor", type=float)
    p.add_argument("--mode", choices=["sync", "partial", "async"], help="rollout mode (rlboost/orchestrator.py)")
    p.add_argument("--max-staleness", type=int, help="async: versions a trained token may lag")
    p.add_argument("--shuffle-rewards", action="store_true", default=None,
                   help="control: rewards shuffled within each group")
    p.add_argument("--chaos", type=_chaos_flag, help="e.g. 3:term,5:kill (mid-step, then restart)")
    p.add_argument("--save-rollouts", action="store_true", default=None, help="write every response to rollouts.jsonl")
    p.add_argument("--model-dir", help="a Hugging Face causal-LM folder (read only; default: the "
                   "demo model in the data dir, built on first use)")
    p.add_argument("--init-model", action="store_true", default=None, help="build the demo model into --model-dir "
                   "first if it is missing (like `rlboost init-model --out`; refused for a folder init-model did not make)")
    p.add_argument("--run-dir")
    p.add_argument("--nproc", type=int, help="trainer ranks: FSDP2 under torchrun (launched for you)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32", "fp64"])
    p.add_argument("--device")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its last checkpoint")
    g = p.add_argument_group("data and reward (settings [data])")
    g.add_argument("--task", help="built-in task: addition (generated) | math")
    g.add_argument("--data", help="training data: JSONL, Parquet or a datasets folder")
    g.add_argument("--eval-data", help="held-out data (default: a split of --data)")
    g.add_argument("--reward", help="module:fn | path/to/file.py:fn | addition | math")
    g.add_argument("--max-prompt-tokens", type=int)
    g.add_argument("--max-response-tokens", type=int)
    g.add_argument("--eval-size", type=int)
    g.add_argument("--epochs", type=int, help="0 = as many as the steps need")
    g.add_argument("--reward-timeout", type=float, help="seconds per reward call")
    g.add_argument("--env", help="train on episodes of this environment: calculator | reasoning-gym | textarena | "
                   "gymnasium | module:fn | path/to/file.py:fn (settings [env]; docs/concepts/environments.md)")
    g.add_argument("--harness", metavar="CMD", help="train on sessions of your own agent harness: CMD runs once per "
                   "session against the run's OpenAI-compatible endpoint (settings [harness]; "
                   "docs/guides/agent-harnesses.md)")
    a, rest = p.parse_known_args(argv)
    overrides = parse_overrides(rest)
    for name, key in FLAGS.items():
        value = getattr(a, name)
        if value is not None:
            section, _, k = key.partition(".")
            overrides.setdefault(section, {})[k] = value
    if demo and a.steps is None:
        # a number of steps, not minutes: a time cap gave a busy box too few steps to show learning
        overrides.setdefault("run", {}).setdefault("steps", DEMO_STEPS)
    if a.resume:
        # the run's own effective settings first, then the environment, then this command line
        saved = Path(a.resume) / "settings.toml"
        if not saved.exists():
            raise ConfigError(f"--resume {a.resume}: no settings.toml there (not a run folder)")
        s = load_settings(saved, overrides=overrides)
        saved_ro = load_settings(saved).rollout
        ro, kept = s.rollout, ("mode", "prompts", "overprovision")
        if "partial" in (saved_ro.mode, ro.mode) and any(getattr(ro, k) != getattr(saved_ro, k) for k in kept):
            # a resumed life draws again what its previous one drew since the checkpoint and carries
            # its groups in flight over (`RequestSource.redraw`): the same draws need the same sizes
            raise ConfigError(f"--resume {a.resume}: the run is in rollout.mode = '{saved_ro.mode}' with prompts = "
                              f"{saved_ro.prompts} and overprovision = {saved_ro.overprovision:g}; a partial run's "
                              "resume keeps all three (it draws its groups in flight again under the same ids)")
        if saved_ro.mode == "async" and (s.rollout.mode, s.rollout.max_staleness) != ("async", saved_ro.max_staleness):
            # the steps it published ahead are republished as they were: same mode, same k
            raise ConfigError(f"--resume {a.resume}: the run is in rollout.mode = 'async' with max_staleness = "
                              f"{saved_ro.max_staleness}; a resume keeps both (it republishes the steps published "
                              "ahead of its checkpoint)")
        s.run.run_dir = a.resume
    else:
        s = apply_overrides(s, overrides)
    parse_chaos(s.run.chaos)  # a bad plan fails here, whichever way it was set
    return Invocation(settings=s, resume=bool(a.resume))


def effective_settings(run: Settings, model_dir: str) -> str:
    """settings.toml of a run: start a new run from it (`rlboost --config settings.toml run`) and
    it is the same run (a new id and folder); `--resume` reads it back for this one."""
    s = msgspec.convert(msgspec.to_builtins(run), Settings)
    s.run.run_dir, s.run.run_id, s.run.model_dir, s.run.init_model = "", "", model_dir, False
    return dump_toml(s)


def execute(inv: Invocation, s: Settings | None = None) -> dict:
    """The run `inv` asks for. `s`: the servers, the metrics endpoint and the demo model's home
    (default: the run's own settings; a bench passes the tree it parsed the command line on)."""
    run = inv.settings
    s = run if s is None else s
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    random.seed(run.run.seed)
    ranks = distributed.init_from_env(run.trainer.device)
    try:
        prepared, model_dir = None, run.run.model_dir
        if ranks.leader:  # before anything starts: a bad flag, file or folder fails fast
            prepared = preflight(inv, s)
            model_dir = resolve_model(run.run, s, run.env)
        model_dir = distributed.broadcast(model_dir, ranks)
        if not ranks.leader:
            follow(run, model_dir, ranks)
            return {}
        run_dir = Path(run.run.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        run_dir.mkdir(parents=True, exist_ok=True)
        with running_services(s.services) as (nats_url, redis_url):
            if not inv.resume:
                (run_dir / "settings.toml").write_text(effective_settings(run, model_dir))
            return asyncio.run(train(inv, model_dir, nats_url, redis_url, run_dir, s, ranks, prepared))
    finally:
        distributed.shutdown()


RANKS_ARGV = "RLBOOST_RANKS_ARGV"


def launch_ranks(argv: list[str], nproc: int) -> int:
    """`rlboost run --nproc N ...` = `torchrun --standalone --nproc-per-node N -m rlboost.cli run ...`.

    The command line travels in the environment: torchrun's own parser would otherwise take
    `--nproc` (and any prefix of its options) for one of its own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "rlboost.trainer.command"]
    return subprocess.call(cmd, env={**os.environ, RANKS_ARGV: json.dumps(argv)})


def main(argv: list[str], s: Settings, demo: bool = False) -> int:
    inv = parse(argv, demo, s)
    if inv.settings.run.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch_ranks(sys.argv[1:], inv.settings.run.nproc)
    if "RLBOOST_LOG_LEVEL" not in os.environ:  # the live table is the interface; logs only warn
        configure_logging(json=s.log_json, level="warning")
    try:
        out = execute(inv)
    except (ModelDirError, DataError, RewardError, EngineError, RunLeaseError) as e:  # one line, no traceback
        print(f"rlboost {'demo' if demo else 'run'}: error: {e}", file=sys.stderr)
        code = 2
    else:
        if out:
            print_result(out)
        code = 0
    if distributed.torchrun_rank():  # the ranks have left the group together (execute's shutdown)
        distributed.exit_rank(code)
    return code


if __name__ == "__main__":  # one rank under torchrun, started by `launch_ranks`
    from rlboost import cli

    sys.exit(cli.main(json.loads(os.environ[RANKS_ARGV])))
