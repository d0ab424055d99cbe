"""Generation side of the loop: inference engines, and (later) the multi-turn rollout manager."""
