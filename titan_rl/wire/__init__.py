"""SGLang's weight-update wire formats, shared by the sender (titan_rl.sync, titan_rl.rollout)
and the receiver (the built-in engine), so neither imports the other.

- :mod:`~titan_rl.wire.bucket`: flattened buckets (``FlattenedTensorBucket`` layout) and dtype
  names;
- :mod:`~titan_rl.wire.payload`: ``serialized_named_tensors`` entries (ForkingPickler dumps)
  and the restricted unpickler that reads them;
- :mod:`~titan_rl.wire.group`: the weight-update process group's rendezvous.
"""

from titan_rl.wire.errors import RequestError

__all__ = ["RequestError"]
