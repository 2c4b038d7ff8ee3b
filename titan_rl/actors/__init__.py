"""Ray actors of the RL loop: rollout engines (SGLang or the CPU engine) behind sglang-router.

Import from the modules (nothing is re-exported here: a Ray worker importing the engine
actor's module would otherwise import every module of the package, the rollout client's
torch among them, on the job's start-up path):

* :mod:`~titan_rl.actors.config`: engine and router sections, launches, placed engines;
* :mod:`~titan_rl.actors.engine_process`: the actor owning one server process;
* :mod:`~titan_rl.actors.engine_actor`: the group of engines and the router (driver side);
* :mod:`~titan_rl.actors.server`, :mod:`~titan_rl.actors.router`: the processes;
* :mod:`~titan_rl.actors.recovery`: the driver's recovery of lost engines.
"""
