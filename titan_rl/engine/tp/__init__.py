"""The built-in engine's tensor parallelism (``--tp-size N``): the server process is TP rank 0.

* :mod:`~titan_rl.engine.tp.leader`: rank 0's runner (every operation on the workers first,
  then on its own shard) and the workers' processes; :func:`~titan_rl.engine.tp.leader.
  start_runner` gives the engine its runner at any ``tp_size``;
* :mod:`~titan_rl.engine.tp.worker`: a worker process (ranks 1..N-1);
* :mod:`~titan_rl.engine.tp.shard`: Megatron-style shards of an HF model;
* :mod:`~titan_rl.engine.tp.comm`: the ranks' gloo group, start spec and pipe framing.

Nothing is imported here: :mod:`titan_rl.engine.runner` imports the shards, and the leader
imports the runner.
"""
