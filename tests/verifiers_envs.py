"""Two verifiers (0.4, `verifiers.v1`) environments for tests/test_verifiers_env.py, loaded as
`--env verifiers:tests/verifiers_envs.py` with `[env.options] kind = "tools" | "game"`:

- `tools`: the calculator's word problems (rlboost.envs.calculator's rows, through an in-memory
  `datasets.Dataset`) with one tool server, `Calc`, whose `calc(expression)` tool (bare name, as
  rlboost's calculator names it: the tool-calling test model calls it) appends its idempotency
  key to a file (`calls_file`): a side effect the tests count per key. Its State counts the calls.
  Rewards: `correct` (weight 1), `brevity` (weight 0: a metric in all but name), a metric.
- `game`: guess-the-number, a one-seat `Env` whose `run()` drives the seat turn by turn (higher /
  lower feedback), seeded by the task, reward recorded on the seat's trace; plus the task's own
  `@vf.reward`.
- `refused_*`: environments the native path refuses, one per reason.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import verifiers.v1 as vf

from rlboost.envs import calculator
from rlboost.envs.verifiers_env import call_key

# ---------------------------------------------------------------- tools


class CalcToolsConfig(vf.ToolsetConfig):
    calls_file: str = ""


class CalcState(vf.State):
    calls: int = 0
    notes: list[str] = []


class Calc(vf.Toolset[CalcToolsConfig, CalcState]):
    TOOL_PREFIX = None  # the bare name `calc`

    @vf.tool
    def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly."""
        if self.config.calls_file:
            with open(self.config.calls_file, "a") as f:
                f.write(call_key() + "\n")
        self.state.calls += 1
        return calculator.evaluate(expression)

    @vf.tool
    async def note(self, text: str) -> str:
        """Keep a note for later in this episode; answers how many are kept."""
        self.state.notes = [*self.state.notes, text]
        return str(len(self.state.notes))


class CalcTaskConfig(vf.TaskConfig):
    tools: CalcToolsConfig = CalcToolsConfig()


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTask(vf.Task[CalcData, CalcState, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [Calc(config.tools)]

    @vf.reward
    async def correct(self, task, trace) -> float:
        got = calculator.final_answer(trace.last_reply)
        return float(got is not None and got == task.answer)

    @vf.reward(weight=0.0)
    async def brevity(self, trace) -> float:
        return 1.0 / (1 + len(trace.last_reply))

    @vf.metric
    async def state_calls(self, trace) -> float:
        return float(trace.state.calls)


class CalcTasksetConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()
    n: int = 256


class CalcTaskset(vf.Taskset[CalcTask, CalcTasksetConfig]):
    def load(self):
        import datasets

        rows = calculator.rows("train", self.config.n, seed=5, level="small")
        ds = datasets.Dataset.from_list([{"question": r["question"], "answer": str(r["answer"])} for r in rows])
        for r in ds:
            yield CalcTask(CalcData(prompt=r["question"], answer=r["answer"]), self.config.task)


# ---------------------------------------------------------------- a game


class GuessData(vf.TaskData):
    info: dict = {}


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.5)
    async def answered_a_number(self, trace) -> float:
        return float(bool(re.search(r"\d", trace.last_reply)))


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for i in range(64):
            yield GuessTask(GuessData(prompt="Guess my number, 1 to 9. Answer with a digit.",
                                      info={"secret": 1 + (i * 7) % 9, "seed": i}))


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    guesses: int = 4


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        secret = task.data.info["secret"]
        tries, solved = 0, 0.0
        async with agents.player.interaction(task) as i:
            segment = await i.turn()
            while True:
                tries += 1
                digits = re.findall(r"\d", segment.last_reply)
                guess = int(digits[-1]) if digits else None
                if guess == secret:
                    solved = 1.0
                    break
                if tries >= self.config.guesses:
                    break
                hint = "not a digit" if guess is None else ("higher" if guess < secret else "lower")
                segment = await i.turn(f"No, {hint}. Guess again.")
            i.trace.record_reward("solved", solved, 1.0)
            i.trace.record_metric("tries", tries)


# ---------------------------------------------------------------- refused


class TwoSeatsConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    judge: vf.AgentConfig = vf.AgentConfig()


class TwoSeats(vf.Env[TwoSeatsConfig]):
    async def run(self, task, agents):
        await agents.player.run(task)


class OwnLoop(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        await agents.player.run(task)

    async def run_episode(self, task, ctx, *, on_trace=None, on_discard=None):
        raise NotImplementedError


class Grouped(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        await agents.player.run(task)

    async def finalize(self, task, episode):
        top = max(t.reward for t in episode.traces)
        for t in episode.traces:
            t.record_metric("best", float(t.reward == top))


class NeedsBox(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def file_ok(self, trace, runtime) -> float:
        return 1.0


class NeedsBoxTaskset(vf.Taskset[NeedsBox, vf.TasksetConfig]):
    def load(self):
        yield NeedsBox(GuessData(prompt="hi"))


class StoppingTask(CalcTask):
    """A few-shot Messages prompt and a @vf.stop on the trace: two tool results end the episode."""

    @vf.stop
    async def two_calls(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= 2


class FewShotTaskset(vf.Taskset[StoppingTask, CalcTasksetConfig]):
    def load(self):
        shot = [vf.SystemMessage(content="Use the calc tool."), vf.UserMessage(content="What is 2 plus 2?"),
                vf.AssistantMessage(content="Answer: 4")]
        for q, a in (("What is 3 plus 4?", "7"), ("What is 5 plus 6?", "11")):
            yield StoppingTask(CalcData(prompt=[*shot, vf.UserMessage(content=q)], answer=a), self.config.task)


class LeakyState(vf.State):
    handle: object = None  # a live object: it cannot be checkpointed


class Leaky(vf.Toolset[vf.ToolsetConfig, LeakyState]):
    TOOL_PREFIX = None

    @vf.tool
    def open_file(self, path: str) -> str:
        """Open a file and keep it open (in the state: what cannot be checkpointed)."""
        self.state.handle = threading.Lock()
        return "opened"


class LeakyTask(vf.Task[GuessData, LeakyState, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Leaky(vf.ToolsetConfig())]


class LeakyTaskset(vf.Taskset[LeakyTask, vf.TasksetConfig]):
    def load(self):
        yield LeakyTask(GuessData(prompt="Open notes.txt"))


# ---------------------------------------------------------------- the loader


def load_environment(kind: str = "tools", calls_file: str = "", n: int = 256, guesses: int = 4):
    """verifiers' convention: keyword arguments from `[env.options]`."""
    if kind == "tools":
        if calls_file:
            Path(calls_file).parent.mkdir(parents=True, exist_ok=True)
        return CalcTaskset(CalcTasksetConfig(n=n, task=CalcTaskConfig(tools=CalcToolsConfig(calls_file=calls_file))))
    if kind == "game":
        return GuessTaskset(vf.TasksetConfig()), GuessEnv, GuessEnvConfig(guesses=guesses)
    refused = {"two_seats": TwoSeats, "own_loop": OwnLoop, "grouped": Grouped}
    if kind in refused:
        return GuessTaskset(vf.TasksetConfig()), refused[kind]
    if kind == "fewshot":
        return FewShotTaskset(CalcTasksetConfig())
    if kind == "leaky":
        return LeakyTaskset(vf.TasksetConfig())
    if kind == "needs_box":
        return NeedsBoxTaskset(vf.TasksetConfig())
    raise ValueError(f"kind {kind!r}")
