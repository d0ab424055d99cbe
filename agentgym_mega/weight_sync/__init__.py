"""Moving trainer weights into inference engines: one interface, a ZMQ implementation."""

from agentgym_mega.weight_sync.base import WeightSynchronizer
from agentgym_mega.weight_sync.zmq_transport import (
    SyncError,
    SyncStats,
    ZmqWeightSynchronizer,
    endpoint,
    new_secret,
)

__all__ = ["SyncError", "SyncStats", "WeightSynchronizer", "ZmqWeightSynchronizer", "endpoint", "new_secret"]
