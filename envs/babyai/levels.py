"""The original 40 BabyAI levels and the id encoding: level = idx % 40 + 1, seed = idx // 40."""

from __future__ import annotations

import functools
import logging

import gymnasium as gym
import minigrid  # noqa: F401  (registers the BabyAI ids with gymnasium)
from gymnasium.envs.registration import registry
from minigrid.envs.babyai.core import roomgrid_level

log = logging.getLogger(__name__)

LEVELS = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7",
    "GoToObjMazeS7", "GoToImpUnlock", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor",
    "GoToObjDoor", "Open", "OpenRedDoor", "OpenDoorLoc", "OpenRedBlueDoorsDebug",
    "OpenDoorsOrderN4Debug", "Pickup", "UnblockPickup", "PickupLoc", "PickupDistDebug",
    "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying", "Unlock", "UnlockLocalDist",
    "KeyInBox", "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor",
    "FindObjS7", "KeyCorridorS6R3", "OneRoomS20", "MoveTwoAcrossS8N9", "SynthS5R2",
    "SynthLoc", "SynthSeq", "MiniBossLevel", "BossLevel", "BossLevelNoUnlock",
)


def _print_but_rejections(*args, **kwargs) -> None:
    """minigrid's level generator prints each layout it rejects ("Sampling rejected: unreachable
    object") and samples another: routine for many levels, hundreds of lines in a run's log, so
    they go to the debug log. Whatever else it prints still prints."""
    if args[:1] == ("Sampling rejected:",):
        log.debug("minigrid rejected a sampled layout: %s", " ".join(map(str, args[1:])))
    else:
        print(*args, **kwargs)


roomgrid_level.print = _print_but_rejections  # the name that module's code looks print up by


def level_and_seed(data_idx: int) -> tuple[int, int]:
    return data_idx % len(LEVELS) + 1, data_idx // len(LEVELS)


@functools.cache
def env_id(level: int) -> str:
    """The newest registered minigrid id of a level (minigrid retired some v0 ids, e.g. GoToObjS6)."""
    name = LEVELS[level - 1]
    versions = sorted((k for k in registry if k.startswith(f"BabyAI-{name}-v")),
                      key=lambda k: int(k.rsplit("-v", 1)[1]))
    return versions[-1]


def make(level: int):
    """The bare minigrid env (no gymnasium wrappers: the text layer reads its state directly)."""
    return gym.make(env_id(level)).unwrapped
