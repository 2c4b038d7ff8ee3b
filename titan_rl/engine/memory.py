"""The built-in engine's memory as SGLang's ``/release_memory_occupation`` sees it.

Colocated with a trainer, the engine frees what it holds while the trainer trains and takes it
back for the next rollout (torch_memory_saver's tags on SGLang):

- ``kv_cache``: the running batch's cache is dropped (the engine must be idle);
- ``weights``: every parameter's storage is freed on every TP rank; names, shapes and dtypes
  are kept (the runner's ``tensor()`` answers meta tensors), so updates are checked as before,
  and refused until the weights are resumed. Resumed weights hold no values (NaN here, as
  without torch_memory_saver's backup, so a missing weight update shows): load weights before
  generating;
- ``cuda_graph``: nothing on CPU.

Release and resume run on the engine thread (``Engine.call``), between decode steps.
"""

from __future__ import annotations

from collections.abc import Callable

from titan_rl.engine.runner import Runner
from titan_rl.engine.sampling import RequestError

#: SGLang's memory tags (``/release_memory_occupation``); ``cuda_graph`` is a no-op on CPU.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
#: without these the engine cannot generate
SERVING_TAGS = frozenset({"weights", "kv_cache"})


class Memory:
    """Which tags are released now, and how many releases and resumes there were.

    ``running``: the sequences admitted to the batch (a release needs none); ``drop_batch``:
    forget the running batch and the prompts being prefilled (the ``kv_cache`` tag).
    """

    def __init__(
        self, runner: Runner, running: Callable[[], int], drop_batch: Callable[[], None]
    ) -> None:
        self._runner = runner
        self._running = running
        self._drop_batch = drop_batch
        self.released_tags: set[str] = set()
        self.releases = 0
        self.resumes = 0

    @property
    def released(self) -> bool:
        """Whether memory that generation needs (weights or KV cache) is released."""
        return bool(self.released_tags & SERVING_TAGS)

    def release(self, tags: list[str] | None) -> None:
        """Free the memory under SGLang's ``tags`` (None: all)."""
        if self._running() > 0:
            raise RequestError(
                "release_memory_occupation needs an idle engine; pause or wait for requests"
            )
        for tag in tags or MEMORY_TAGS:
            if tag in self.released_tags:
                continue
            if tag == "weights":
                self._runner.release_weights()
            elif tag == "kv_cache":
                self._drop_batch()
            self.released_tags.add(tag)
        self.releases += 1

    def resume(self, tags: list[str] | None) -> None:
        """Allocate released memory again (weights: NaN until loaded)."""
        for tag in tags or MEMORY_TAGS:
            if tag not in self.released_tags:
                continue
            if tag == "weights":
                self._runner.resume_weights()
            self.released_tags.discard(tag)
        self.resumes += 1


__all__ = ["MEMORY_TAGS", "Memory", "SERVING_TAGS"]
