"""Rollout: multi-turn episodes between inference engines and environment servers."""
