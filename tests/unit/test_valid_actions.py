"""The valid-action count of an episode: one per env answer whose `valid_action` is true, carried
into the rollout batch's Episode (what metrics and eval turn into a rate)."""

import threading
import types

from agentgym_mega.rollout.manager import RolloutManager, _Live
from agentgym_mega.rollout.status import Status
from envs.environment import Task


def test_episode_counts_the_replies_the_server_parsed_and_the_batch_keeps_the_count():
    # Stands in for the manager's tokenizing side only: each reply decodes to one text, each
    # observation becomes one token.
    manager = types.SimpleNamespace(turns=types.SimpleNamespace(after_reply=lambda ids, obs: [5]),
                                    _tokenizing=threading.Lock(), max_model_len=100,
                                    tokenizer=types.SimpleNamespace(pad_token_id=0, decode=lambda ids, **_: "a reply"))
    ep = _Live(Task(7, "depth-1"), group_id=0, engine=0, index=0, max_turns=3)
    generation = types.SimpleNamespace(token_ids=[1], logprobs=[-0.5], version=0)
    for valid in (True, False, True):  # the third answer reaches the turn cap
        RolloutManager._take_reply(manager, ep, generation)
        answer = {"observation": "o", "episode_score": 0.0, "success": False, "done": False, "valid_action": valid,
                  "action": "go forward" if valid else ""}
        RolloutManager._take_result(manager, ep, generation, answer)
    assert (ep.status, ep.turns, ep.valid_actions) == (Status.HORIZON, 3, 2)
    # the transcript says which reply was no action, and why
    assert [t["action_error"] for t in ep.transcript["turns"]] == [None, "no action in the reply", None]
    episode = RolloutManager._to_batch(manager, [ep]).episodes[0]
    assert (episode.valid_actions, episode.turns) == (2, 3)
