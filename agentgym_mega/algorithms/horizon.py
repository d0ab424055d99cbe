"""ScalingInter-RL: the cap on interaction turns per episode grows in stages."""

from __future__ import annotations


def turn_cap(step: int, horizon) -> int:
    """Turn cap for 1-based global `step`. With caps [6, 13, 20] and interval 100, steps 1-100
    get 6, 101-200 get 13, then 20. Derived from the step alone, so a resumed run gets the same
    cap as an uninterrupted one at every step, stage boundaries included."""
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if horizon.schedule == "fixed":
        return horizon.caps[0]
    stage = min((step - 1) // horizon.interval, len(horizon.caps) - 1)
    return horizon.caps[stage]
