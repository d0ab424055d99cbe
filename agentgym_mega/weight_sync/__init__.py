"""Moving trainer weights into inference engines: one interface, two transports (ZMQ streams
from trainer rank 0, and a collective per pipeline stage; see config.WeightSyncConfig)."""

from agentgym_mega.weight_sync.base import WeightSynchronizer
from agentgym_mega.weight_sync.collective import CollectiveWeightSynchronizer
from agentgym_mega.weight_sync.zmq_transport import (
    SyncError,
    SyncStats,
    ZmqWeightSynchronizer,
    choose_transport,
    endpoint,
    new_secret,
)

__all__ = ["CollectiveWeightSynchronizer", "SyncError", "SyncStats", "WeightSynchronizer", "ZmqWeightSynchronizer",
           "choose_transport", "endpoint", "new_secret"]
