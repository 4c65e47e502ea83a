"""The parts `rlboost run` wires (trainer/run.py), each on its own: the request source's ids,
seeds, life tags and checkpoint position; when a resumed life must name its requests anew; the
seeding window's state through a checkpoint. The run end to end is tests/test_run.py and
tests/test_resume.py."""

from __future__ import annotations

import json

import pytest

from rlboost.offload import SeedWindow
from rlboost.trainer.data import GeneratedData, PromptBudget
from rlboost.trainer.model import DEMO_CONTEXT, build_tokenizer
from rlboost.trainer.request_source import PromptSource
from rlboost.trainer.resume import Resumed, fresh_from
from rlboost.trainer.tasks import get_task


def source(life: str = "l1") -> PromptSource:
    task = get_task("addition")
    budget = PromptBudget.for_model(1024, 0, DEMO_CONTEXT, task.max_response_chars + 1)
    return PromptSource(GeneratedData(task, seed=0), build_tokenizer(task.alphabet), budget, [0], run_id="r1",
                        seed=7, samples=2, temperature=1.0, life=life)


async def test_a_step_is_named_seeded_and_drawn_the_same_way_each_time():
    a, b = source(), source()
    qa, qb = await a.requests(0, 0, 3), await b.requests(0, 0, 3)
    assert len(qa) == 6 and qa[0].request_id == "r1-s00000-p00000-g000" and qa[-1].group == 2
    assert [(q.request_id, q.seed, q.prompt_ids) for q in qa] == [(q.request_id, q.seed, q.prompt_ids) for q in qb]
    assert len({q.seed for q in qa}) == 6  # every sample its own seed
    assert (await a.requests(1, 0, 1))[0].prompt_ids != qa[0].prompt_ids  # the data moved on


async def test_fresh_ids_tag_the_steps_from_there_and_the_tag_travels_with_the_checkpoint():
    src = source()
    src.fresh_ids(2)
    assert (await src.requests(1, 0, 1))[0].request_id.startswith("r1-s00001-")
    assert (await src.requests(2, 0, 1))[0].request_id.startswith("r1-l1-s00002-")
    assert not src.publish_ahead(1) and src.publish_ahead(2)
    position = src.position({}, 2, 0)
    assert position["request_tag"] == "l1"
    later = source(life="l2")
    later.restore(position)
    assert (await later.requests(3, 0, 1))[0].request_id.startswith("r1-l1-s00003-")  # the checkpoint's life's ids


async def test_a_partial_checkpoint_draws_its_groups_in_flight_again_under_their_ids():
    src = source()
    first = await src.requests(0, 0, 3)
    src.scored((0, 0))
    position = src.position({0: [1, 2]}, 0, 1)
    assert position["draws"] == {"0": [3, 0]}  # 3 groups, published under version 0
    later = source(life="l2")
    later.restore({**position, "carried": {"0": [1, 2]}})
    [(step, carried)] = await later.redraw(1)
    assert step == 0 and later.drawn_under(0) == 0
    assert [(q.request_id, q.prompt_ids) for q in carried] == [(q.request_id, q.prompt_ids) for q in first
                                                               if q.group in (1, 2)]
    assert later.sample((0, 1)).index == src.sample((0, 1)).index
    with pytest.raises(KeyError):
        later.sample((0, 0))  # trained before the checkpoint: not drawn into this life's groups


def test_a_resumed_life_names_its_requests_anew_only_where_it_cannot_take_the_dead_life_s():
    r = Resumed(resumed=True, first_step=4)
    assert fresh_from("past", r, "sync")[0] == 5  # the checkpoint's version goes on for the step after it
    assert fresh_from("gone", r, "async")[0] == 4
    assert fresh_from("kept", r, "sync") is None
    assert fresh_from("gone", r, "partial") is None  # partial trains off-policy: takes them as they are
    assert fresh_from("new", Resumed(), "sync") is None


def test_the_seeding_window_comes_back_from_a_checkpoint_as_it_was():
    w = SeedWindow(initial_s=2.0, floor_s=0.5)
    w.window(2)
    w.update(2, 3.0, 0.0)
    w.window(3)
    w.update(3, 0.0, 1.2)
    back = SeedWindow(initial_s=9.0, floor_s=0.5)
    back.load_state(json.loads(json.dumps(w.state())))
    assert back.state() == w.state() and back.t_seed != 9.0
    assert back.window(2) == w.window(2) and back.window(5) == w.window(5)
