"""Moving trainer weights into inference engines: the interface (base), one factory that
resolves the transport and builds each trainer rank's synchronizer (factory), and the transports
behind it (ZMQ streams from trainer rank 0, CUDA IPC per GPU, a collective per pipeline stage;
see config.WeightSyncConfig), and the topology that picks between them (which groups a layout
forms, none holding a GPU twice). Code outside this package imports this module, base, factory and
loopback (`bench sync`'s raw transports) only, never a transport's own module
(tests/unit/test_weight_sync_seam.py)."""

from agentgym_mega.weight_sync.auth import new_secret
from agentgym_mega.weight_sync.base import Receiver, SyncError, SyncStats, WeightSynchronizer
from agentgym_mega.weight_sync.factory import for_trainer_rank, receiver_of
from agentgym_mega.weight_sync.topology import (
    DEVICES_ENV,
    SyncGroup,
    SyncLayout,
    choose_transport,
    planned_layout,
    sync_groups,
)

__all__ = ["DEVICES_ENV", "Receiver", "SyncError", "SyncGroup", "SyncLayout", "SyncStats", "WeightSynchronizer",
           "choose_transport", "for_trainer_rank", "new_secret", "planned_layout", "receiver_of", "sync_groups"]
