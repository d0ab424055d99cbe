"""Task selection (split, ids, categories) and the task sampler, which walks a seeded shuffle of
the tasks and resumes exactly from its position."""

import pytest

from agentgym_mega.rollout.tasks import TaskSampler
from envs.environment import Task

TASKS = [Task(i) for i in range(10)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = TaskSampler(TASKS, seed=3)
    first, second = sampler.next(10), sampler.next(10)
    assert sorted(t.id for t in first) == list(range(10)) == sorted(t.id for t in second)
    assert [t.id for t in first] != [t.id for t in second]


def test_resuming_at_a_position_continues_the_same_sequence():
    uninterrupted = TaskSampler(TASKS, seed=3)
    expected = [t.id for t in uninterrupted.next(23)]
    head = TaskSampler(TASKS, seed=3)
    got = [t.id for t in head.next(7)]
    resumed = TaskSampler(TASKS, seed=3, position=head.position)
    got += [t.id for t in resumed.next(16)]
    assert got == expected and resumed.position == 23


def test_no_tasks_is_a_clear_error():
    with pytest.raises(ValueError, match="no tasks"):
        TaskSampler([], seed=0)


CATALOGUE = [Task(0, "GoToRedBall", "test"), Task(1, "GoToDoor", "test"),
             Task(40, "GoToRedBall", "train"), Task(41, "GoToDoor", "train")]


def test_select_tasks_by_split_ids_and_categories():
    from agentgym_mega.errors import BadInput
    from agentgym_mega.rollout.tasks import select_tasks

    assert [t.id for t in select_tasks(CATALOGUE, "train", None, None)] == [40, 41]
    assert [(t.id, t.category) for t in select_tasks(CATALOGUE, "test", None, ["GoToDoor"])] == [(1, "GoToDoor")]
    # explicit ids keep their meaning even when the catalogue does not list them
    explicit = select_tasks(CATALOGUE, "train", [0, 9999], None)
    assert [(t.id, t.category) for t in explicit] == [(0, "GoToRedBall"), (9999, "")]
    assert [t.id for t in select_tasks(CATALOGUE, "train", [0, 1, 41], ["GoToDoor"])] == [1, 41]
    with pytest.raises(BadInput, match=r"env.categories: unknown \['Nope'\].*GoToDoor, GoToRedBall"):
        select_tasks(CATALOGUE, "train", None, ["GoToDoor", "Nope"])
