"""Weight sync trainer -> rollout engines (tensor, distributed, disk, Mooncake)."""

from titan_rl.sync.config import SyncConfig
from titan_rl.sync.sync import ParityError, WeightSync, WeightSyncError

__all__ = ["ParityError", "SyncConfig", "WeightSync", "WeightSyncError"]
