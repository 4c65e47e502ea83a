"""A step's requests from data rows: `RequestSource`, and `PromptSource` (single-turn prompts).

The run's task (`rlboost.trainer.data_task.DataTask`, the orchestrator's `RolloutTask`) asks a source for
a step's requests (`await requests(step, version, groups)`), which row group `key` answers, to
score it (`sample`), and forgets the row once the group is scored (`scored`). What a row becomes
is the subclass's (`_draw`): a prompt's `samples` requests (`PromptSource`, here), a row's
`samples` episodes (`rlboost.trainer.episodes.source.EpisodeSource`); an outside environment's sessions
can be another.

What the base owns and why:

- request ids and seeds: every request of a run is named by (run, step, prompt, sample) and
  seeded from (run seed, step, prompt, sample), so a step drawn again (a resumed run) is the
  same step, token for token. A resumed life that cannot take what its previous life published
  for a step (`fresh_ids`) names that step's requests and the later ones with its own tag:
  `<run>-<life>-s<step>-...` (the tag then travels with the checkpoint, `request_tag`);
- the data position before each draw: an async run draws steps ahead and a partial run carries
  groups of earlier steps, so a checkpoint keeps the position before the first draw whose groups
  are not all trained, with each draw's size since (`position`), and a resumed life draws them
  again (`redraw`) under the same ids;
- the count of rows dropped before the step (`filtered_total`, and per step `step_filtered`):
  a prompt over its token budget, a row whose episode does not open, replaced by the next one.
"""

from __future__ import annotations

import hashlib

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.trainer.data import PromptBudget, Sample, encode_prompt


def request_seed(run_seed: int, step: int, prompt: int, sample: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{run_seed}/{step}/{prompt}/{sample}".encode(), digest_size=4).digest(),
                          "little")


class RequestSource:
    """Ids, seeds and the data position of a step's requests; what a row becomes is `_draw`'s."""

    def __init__(self, data, *, run_id: str, seed: int, samples: int, temperature: float, life: str = "",
                 component: str = "requests") -> None:
        """`life`: this life's tag (`LocalFleet.life`), for the ids of requests it cannot take from
        a previous life."""
        self.data = data
        self.run_id, self.seed, self.samples, self.temperature = run_id, seed, samples, temperature
        self.life = life
        # request ids: `<run>[-<tag>]-s<step>-...`; steps from `fresh_from` on carry this life's tag,
        # earlier ones the tag of the checkpoint's life (`fresh_ids`)
        self.resumed_tag, self.fresh_from = "", None
        self.log = get_logger(component=component, run_id=run_id)
        self.filtered_total = 0  # rows dropped before their step, this run (every life)
        self.step_filtered = 0  # since the caller last set it to 0 (a step's row)
        self._samples: dict[tuple[int, int], object] = {}  # (step, group) -> its row, until scored
        # step -> (data position, filtered, groups drawn, version published under), the first two from
        # before its draw: what a checkpoint needs to make a resumed life draw the same prompts
        self._drawn_from: dict[int, tuple[dict, int, int, int]] = {}
        self._resumed: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})  # see restore()

    # ------------------------------------------------------------------ the task's port

    async def requests(self, step: int, version: int, groups: int) -> list[wire.RolloutRequest]:
        """A step's requests: `groups` rows, `samples` requests each, under `version`."""
        # where the data stood before the step's draw: an async run publishes steps ahead, and a
        # checkpoint keeps the position of its first untrained step (`position`)
        self._drawn_from.setdefault(step, (self.data.state(), self.filtered_total, groups, version))
        return await self._draw(step, version, groups, "-".join(filter(None, (self.run_id, self.tag(step)))))

    async def _draw(self, step: int, version: int, groups: int, run: str) -> list[wire.RolloutRequest]:
        """`groups` rows drawn from the data, each group's row kept (`_keep`), each dropped one
        counted (`_dropped`); their requests named `wire.request_id(step, group, sample, run=run)`
        and seeded `request_seed(self.seed, step, group, sample)`."""
        raise NotImplementedError

    def _keep(self, key: tuple[int, int], row: object) -> None:
        self._samples[key] = row

    def _dropped(self, n: int = 1) -> None:
        self.filtered_total += n
        self.step_filtered += n

    def fresh_ids(self, step: int) -> None:
        """The requests of `step` and later get this life's own ids: what its previous life
        published for them is not for this life (see `rlboost.trainer.resume.fresh_from`), so they are
        generated again; the ones the previous life left queued are served, and their results
        answer no request of this life."""
        self.fresh_from = step

    def tag(self, step: int) -> str:
        return self.life if self.fresh_from is not None and step >= self.fresh_from else self.resumed_tag

    def publish_ahead(self, step: int) -> bool:
        """Async: nothing is published ahead before `fresh_from` (requests published under this
        version would be more than k versions old one step later)."""
        return self.fresh_from is None or step >= self.fresh_from

    # ------------------------------------------------------------------ the task's questions

    def sample(self, key: tuple[int, int]):
        """The row (a prompt and its ground truth, an episode's row) group `key` answers."""
        return self._samples[key]

    def scored(self, key: tuple[int, int]) -> None:
        """Group `key` is scored: its row is no longer needed."""
        self._samples.pop(key, None)

    # ------------------------------------------------------------------ checkpoint and resume

    def drawn_under(self, step: int) -> int:
        """The version `step`'s requests were published under (the oldest its tokens may be)."""
        return self._drawn_from[step][3]

    def position(self, carried: dict[int, list[int]], step: int, version: int) -> dict:
        """The checkpoint's part after `step`: the data position before the first draw whose groups
        are not all trained (`carried`: a partial run's groups in flight, by step), the draws since."""
        first = min(carried, default=step + 1)
        for s in [s for s in self._drawn_from if s < first]:
            del self._drawn_from[s]
        data_state, filtered_total, _, _ = self._drawn_from.get(
            first, (self.data.state(), self.filtered_total, 0, version))
        return {"data_state": data_state, "filtered_total": filtered_total,
                "request_tag": self.tag(step + 1),  # of the requests after it (`fresh_ids`)
                "draws": {str(s): list(self._drawn_from[s][2:]) for s in range(first, step + 1)} if carried else {}}

    def restore(self, state: dict) -> None:
        """The checkpoint's part back (before the first step): the data position, and what to draw again."""
        if state.get("data_state") is not None:
            self.data.load_state(state["data_state"])
        self.filtered_total = state.get("filtered_total", 0)
        self.resumed_tag = state.get("request_tag", "")
        self._resumed = ({int(s): n for s, n in (state.get("draws") or {}).items()},
                         {int(s): gs for s, gs in (state.get("carried") or {}).items()})

    async def redraw(self, version: int) -> list[tuple[int, list[wire.RolloutRequest]]]:
        """A resumed partial run: draw again what its previous life drew from the checkpoint's data
        position on (the same prompts under the same request ids). Returns, by step, the requests
        of the groups it had not trained: the orchestrator publishes and collects them again."""
        draws, carried = self._resumed
        out = []
        for s in sorted(draws):
            (groups, drawn_version), keep = draws[s], set(carried.get(s, ()))
            requests = await self.requests(s, version, groups)  # the floor is this version anyway
            self._drawn_from[s] = (*self._drawn_from[s][:3], drawn_version)  # what its tokens may be as old as
            for g in set(range(groups)) - keep:
                self._samples.pop((s, g), None)  # trained before the checkpoint
            if keep:
                out.append((s, [q for q in requests if q.group in keep]))
        if carried:
            self.log.info("carried over from the checkpoint", groups=sum(map(len, carried.values())),
                          steps=sorted(carried))
        return out


class PromptSource(RequestSource):
    """Single-turn prompts: a row's prompt within the token budget, `samples` requests of it. A
    prompt over its budget is dropped before the step, replaced by the next one, counted and logged."""

    def __init__(self, data, tokenizer, budget: PromptBudget, stops: list[int], *, run_id: str, seed: int,
                 samples: int, temperature: float, life: str = "") -> None:
        super().__init__(data, run_id=run_id, seed=seed, samples=samples, temperature=temperature, life=life)
        self.tokenizer, self.budget, self.stops = tokenizer, budget, stops

    async def _draw(self, step: int, version: int, groups: int, run: str) -> list[wire.RolloutRequest]:
        samples, prompt_ids = self._prompts(step, groups)
        for p, smp in enumerate(samples):
            self._keep((step, p), smp)
        return [wire.RolloutRequest(
            request_id=wire.request_id(step, p, g, run=run), step=step, policy_version=version,
            prompt_ids=ids, max_new_tokens=self.budget.max_response_tokens, seed=request_seed(self.seed, step, p, g),
            sampling=wire.SamplingParams(temperature=self.temperature),
            eos_id=self.stops[0] if self.stops else -1, stop_ids=self.stops, group=p)
            for p, ids in enumerate(prompt_ids) for g in range(self.samples)]

    def _prompts(self, step: int, n: int) -> tuple[list[Sample], list[list[int]]]:
        """The step's prompts within the token budget; the ones over it are dropped and replaced."""
        filtered = 0

        def dropped(smp: Sample, n_tokens: int) -> None:
            nonlocal filtered
            filtered += 1
            self.log.warning("prompt over the token budget: filtered", step=step, sample=smp.index, tokens=n_tokens,
                             limit=self.budget.limit)

        chosen = self.budget.fill(self.data.next_batch, lambda smp: encode_prompt(self.tokenizer, smp),
                                  n, dropped)
        self._dropped(filtered)  # counted once the step's prompts are in (not for a draw the data ran out in)
        return [smp for smp, _ in chosen], [ids for _, ids in chosen]
