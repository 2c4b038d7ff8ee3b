"""Weight sync trainer -> rollout engines (tensor, distributed, disk, Mooncake)."""

from titan_rl.sync.config import SyncConfig
from titan_rl.sync.sync import WeightSync, WeightSyncError

__all__ = ["SyncConfig", "WeightSync", "WeightSyncError"]
