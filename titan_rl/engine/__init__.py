"""The built-in CPU rollout engine: an HTTP server speaking SGLang's native API.

``python -m titan_rl.engine --model-path P --host 127.0.0.1 --port N``. See
:mod:`titan_rl.engine.core` for the batching design and :mod:`titan_rl.engine.sampling`
for the logprob definition.
"""
