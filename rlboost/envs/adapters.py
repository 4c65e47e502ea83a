"""Environments from libraries users already have (install them with `pip install rlboost[envs]`).

- `reasoning_gym(dataset=...)`: any of reasoning-gym's ~100 procedural task generators
  (arithmetic, logic, puzzles, ...), scored by the task's own verifier. Offline and seeded, so
  rows are a pure function of a seed; the held-out split is a separate seed range with any
  training question that also appears there removed. `attempts > 1` makes it multi-turn: a
  wrong answer gets "not correct, try again" and the reward is the final attempt's score.
- `textarena(game=...)`: textarena's single-player text games (GuessTheNumber, TowerOfHanoi,
  Minesweeper, ...): genuinely multi-turn, the game answers every move. Games that need
  downloaded word lists (Wordle, Hangman) fail at start with textarena's own message.
- `gymnasium(env_id=...)`: a gymnasium environment played in text: a string observation as it
  is, any other one through the env's `ansi` rendering; the model moves with `[k]` (an action
  number) or an action name.

textarena and gymnasium keep their state in Python objects that do not serialise. The adapters
keep what does instead, the seed and the moves so far (`{"seed": s, "moves": [...]}`), and
rebuild the game by replaying the moves: deterministic for a seeded game, so an episode resumes
on any machine. A replay runs under a lock (some games draw from the global `random` module).
"""

from __future__ import annotations

import re
import threading
from typing import Any

from rlboost.envs.protocol import Context, Env, EnvError, Message, ModelTurn, Opening, Reply, Score, user

_REPLAY_LOCK = threading.Lock()
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_ANSWER_LINE = re.compile(r"(?im)^\s*answer:\s*(.+?)\s*$")


def _need(module: str, extra: str = "envs"):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise EnvError(f"this environment needs the {module.replace('_', '-')} package: pip install "
                       f"'rlboost[{extra}]' ({e})") from None


def extract_answer(text: str) -> str:
    """The answer in a model's text: the last `<answer>...</answer>`, else the last
    `Answer: ...` line, else the whole text."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    lines = _ANSWER_LINE.findall(text)
    return lines[-1].strip() if lines else text.strip()


# ---------------------------------------------------------------- reasoning-gym


class ReasoningGymEnv(Env):
    """One reasoning-gym task. A row is `{"question", "answer", "metadata"}` (what reasoning-gym
    yields; a row from a file works too) plus `rg_seed`/`rg_index` when it came from `rows()`,
    which rebuilds the entry for the task's own scorer."""

    name = "reasoning-gym"
    HELD_OUT_SEED = 1_000_000_007
    INSTRUCTIONS = "Give your final answer as <answer>...</answer>."

    def __init__(self, dataset: str = "basic_arithmetic", attempts: int = 1, instructions: bool = True,
                 eval_size: int = 256, **config: Any) -> None:
        self.rg = _need("reasoning_gym")
        self.dataset, self.attempts, self.instructions = dataset, max(1, attempts), instructions
        self.eval_size, self.config = eval_size, config
        self._datasets: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._source(0)  # an unknown task name or a bad option fails here, once

    def _source(self, seed: int):
        with self._lock:
            if seed not in self._datasets:
                try:
                    self._datasets[seed] = self.rg.create_dataset(self.dataset, size=1 << 30, seed=seed,
                                                                  **self.config)
                except Exception as e:
                    raise EnvError(f"reasoning-gym {self.dataset!r}: {e}") from None
            return self._datasets[seed]

    def rows(self, split: str = "train", n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
        if split not in ("train", "test"):
            raise ValueError(f"split {split!r}: train or test")

        def draw(s: int, k: int, skip: set[str]) -> list[dict[str, Any]]:
            ds, out, i = self._source(s), [], 0
            while len(out) < k and i < 50 * k + 100:
                e = ds[i]
                if e["question"] not in skip:
                    out.append({"question": e["question"], "answer": str(e["answer"]), "rg_dataset": self.dataset,
                                "rg_seed": s, "rg_index": i, "data_source": f"reasoning_gym/{self.dataset}"})
                i += 1
            return out

        if split == "test":
            return draw(self.HELD_OUT_SEED + seed, n, set())
        held = {r["question"] for r in draw(self.HELD_OUT_SEED, self.eval_size, set())}
        return draw(seed, n, held)

    def _entry(self, row_or_state: dict[str, Any]) -> dict[str, Any]:
        if "rg_index" in row_or_state:
            return self._source(int(row_or_state["rg_seed"]))[int(row_or_state["rg_index"])]
        return {"question": row_or_state.get("question", ""), "answer": row_or_state.get("answer"),
                "metadata": row_or_state.get("metadata") or {}}

    def start(self, row: dict[str, Any], ctx: Context) -> Opening:
        if "question" not in row:
            raise ValueError("a reasoning-gym row needs a question")
        text = str(row["question"]) + (f"\n{self.INSTRUCTIONS}" if self.instructions else "")
        keep = {k: row[k] for k in ("rg_seed", "rg_index", "question", "answer", "metadata") if k in row}
        return Opening(messages=[user(text)], state={**keep, "attempt": 0, "score": 0.0})

    def _score(self, state: dict[str, Any], answer: str) -> float:
        entry = self._entry(state)
        try:
            ds = self._source(int(state.get("rg_seed", 0)))
            return float(ds.score_answer(answer=answer, entry=entry) or 0.0)
        except Exception:
            return float(answer.strip() == str(entry.get("answer", "")).strip())

    def respond(self, transcript: list[Message], turn: ModelTurn, state: Any, ctx: Context) -> Reply:
        score = self._score(state, extract_answer(turn.text))
        new = {**state, "attempt": state["attempt"] + 1, "score": score}
        done = score >= 1.0 or new["attempt"] >= self.attempts
        msgs = [] if done else [user("That is not correct. Try again.")]
        return Reply(messages=msgs, done=done, state=new, set_state=True)

    def score(self, transcript: list[Message], state: Any, ctx: Context) -> Score:
        return Score(reward=float(state["score"]), metrics={"correct": float(state["score"] >= 1.0),
                                                            "attempts": float(state["attempt"])})


def reasoning_gym(dataset: str = "basic_arithmetic", **options: Any) -> ReasoningGymEnv:
    return ReasoningGymEnv(dataset=dataset, **options)


# ---------------------------------------------------------------- replayed games


class ReplayEnv(Env):
    """A game whose live object does not serialise: state is the seed and the moves; every
    call rebuilds the game by replaying them. Subclasses write `_new(seed)`, `_observation(game)`
    and `_move(game, text) -> (reward, done)`."""

    accumulates = False  # each observation repeats the earlier ones (textarena)

    def _new(self, seed: int) -> Any:
        raise NotImplementedError

    def _observation(self, game: Any) -> str:
        raise NotImplementedError

    def _move(self, game: Any, text: str) -> tuple[float, bool]:
        raise NotImplementedError

    def _replay(self, state: dict[str, Any]) -> tuple[Any, float, bool]:
        game = self._new(int(state["seed"]))
        total, done = 0.0, False
        for move in state["moves"]:
            reward, done = self._move(game, move)
            total += reward
        return game, total, done

    def start(self, row: dict[str, Any], ctx: Context) -> Opening:
        seed = int(row.get("seed", ctx.seed % (1 << 31)))
        with _REPLAY_LOCK:
            game = self._new(seed)
            text = self._observation(game)
        return Opening(messages=[user(text)], state={"seed": seed, "moves": [], "shown": len(text), "reward": 0.0,
                                                    "done": False})

    def respond(self, transcript: list[Message], turn: ModelTurn, state: Any, ctx: Context) -> Reply:
        move = turn.text or turn.raw
        with _REPLAY_LOCK:
            game, _, _ = self._replay(state)
            reward, done = self._move(game, move)
            text = "" if done else self._observation(game)
            total = state["reward"] + reward
        new = {**state, "moves": state["moves"] + [move], "reward": total, "done": done}
        if done:
            return Reply(done=True, state=new, set_state=True)
        shown = state["shown"]
        # an accumulating observation (the whole game so far) is shown from where it was left
        delta = text[shown:] if self.accumulates and len(text) > shown else text
        new["shown"] = len(text)
        return Reply(messages=[user(delta.strip() or text)], state=new, set_state=True)

    def score(self, transcript: list[Message], state: Any, ctx: Context) -> Score:
        return Score(reward=float(state["reward"]), metrics={"won": float(state["reward"] > 0),
                                                             "moves": float(len(state["moves"])),
                                                             "finished": float(state["done"])})

    def rows(self, split: str = "train", n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
        """Seeds as rows: the test split takes its own seed range."""
        if split not in ("train", "test"):
            raise ValueError(f"split {split!r}: train or test")
        base = (1 << 30 if split == "test" else 0) + seed * n
        return [{"seed": base + i, "data_source": self.name} for i in range(n)]


class TextArenaEnv(ReplayEnv):
    """A textarena single-player game. textarena's observation is the whole game so far; the
    model sees the opening, then after each move only what is new."""

    accumulates = True

    def __init__(self, game: str = "GuessTheNumber-v0") -> None:
        self.ta = _need("textarena")
        self.game, self.name = game, f"textarena/{game}"
        try:
            self.ta.make(game)
        except Exception as e:
            raise EnvError(f"textarena {game!r}: {e}") from None

    def _new(self, seed: int) -> Any:
        env = self.ta.make(self.game)
        env.reset(num_players=1, seed=seed)
        return env

    def _observation(self, game: Any) -> str:
        _, obs = game.get_observation()
        if isinstance(obs, list):  # some versions give (sender, message) pairs
            obs = "\n".join(m if isinstance(m, str) else str(m[-1]) for m in obs)
        return str(obs)

    def _move(self, game: Any, text: str) -> tuple[float, bool]:
        done, _ = game.step(text)
        if not done:
            return 0.0, False
        rewards, _ = game.close()
        return float((rewards or {}).get(0, 0.0)), True


def textarena(game: str = "GuessTheNumber-v0") -> TextArenaEnv:
    return TextArenaEnv(game=game)


_ANSI_MARK = re.compile(r"\x1b\[4\dm(.*?)\x1b\[0m", re.S)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ACTION = re.compile(r"\[(\d+)\]")


class GymnasiumEnv(ReplayEnv):
    """A gymnasium environment in text. `actions` names the discrete actions (the model may
    write a name or `[k]`); a text the env cannot read as an action ends the episode with 0."""

    def __init__(self, env_id: str = "FrozenLake-v1", actions: list[str] | None = None, **make_kwargs: Any) -> None:
        self.gym = _need("gymnasium")
        self.env_id, self.name, self.make_kwargs = env_id, f"gymnasium/{env_id}", make_kwargs
        probe = self._make()
        n = getattr(probe.action_space, "n", None)
        if n is None:
            raise EnvError(f"gymnasium {env_id!r}: only discrete action spaces are played in text")
        self.actions = actions or (["left", "down", "right", "up"] if env_id.startswith("FrozenLake")
                                   else [str(i) for i in range(int(n))])
        probe.close()

    def _make(self):
        try:
            return self.gym.make(self.env_id, render_mode="ansi", **self.make_kwargs)
        except Exception as e:
            raise EnvError(f"gymnasium {self.env_id!r}: {e}") from None

    def _new(self, seed: int) -> Any:
        env = self._make()
        obs, _ = env.reset(seed=seed)
        return {"env": env, "obs": obs}

    def _observation(self, game: Any) -> str:
        obs = game["obs"]
        if isinstance(obs, str):
            board = obs
        else:
            board = _ANSI.sub("", _ANSI_MARK.sub(r"*\1*", str(game["env"].render() or obs)))
        moves = ", ".join(f"[{i}] {a}" for i, a in enumerate(self.actions))
        return f"{board.strip()}\nMoves: {moves}"

    def _move(self, game: Any, text: str) -> tuple[float, bool]:
        found = _ACTION.findall(text)
        lowered = text.strip().lower()
        if found and int(found[-1]) < len(self.actions):
            action = int(found[-1])
        elif lowered in self.actions:
            action = self.actions.index(lowered)
        else:
            return 0.0, True
        obs, reward, terminated, truncated, _ = game["env"].step(action)
        game["obs"] = obs
        return float(reward), bool(terminated or truncated)


def gymnasium(env_id: str = "FrozenLake-v1", **options: Any) -> GymnasiumEnv:
    return GymnasiumEnv(env_id=env_id, **options)
