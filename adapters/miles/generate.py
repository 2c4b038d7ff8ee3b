"""The rollout function of ``python -m adapters.miles.train`` (``--rollout-function-path``).

miles' own rollout (``miles.rollout.sglang_rollout`` and the ``inference_rollout`` package)
imports ``sglang`` at the top, and its ``RolloutFnTrainOutput`` lives in
``miles.rollout.base_types``, which does too. :func:`generate_rollout` keeps miles' legacy
signature ``fn(args, rollout_id, data_source, evaluation=False)`` and answers an object with
miles' output attributes (``samples`` and ``metrics``; ``data`` and ``metrics`` for an
evaluation). Each sample is generated with miles' own request and response code
(``miles.rollout.generate_utils.generate_endpoint_utils``: ``compute_request_payload``,
``update_sample_from_response``), posted to ``args.sglang_router_ip:port`` by Titan's
``SGLangClient``, and scored by miles' reward hub (``--rm-type``, or ``--custom-rm-path``:
``adapters.slime.rewards.exact_match`` and ``.math_verify`` score miles' ``Sample`` as they
score slime's). Evaluations run the ``--eval-prompt-data NAME PATH`` sets
(``--n-samples-per-eval-prompt`` responses per prompt; ``eval/NAME`` is a set's mean reward),
else the data source's ``eval_samples()``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from adapters.common.clients import engine_url, get_client, run_tokenizer
from adapters.common.rollout import eval_data, rollout_groups, summary
from adapters.peers import import_peer

_endpoint = import_peer("miles.rollout.generate_utils.generate_endpoint_utils")
_types = import_peer("miles.utils.types")
_misc = import_peer("miles.utils.misc")


async def generate(args: Any, sample: Any, params: dict[str, Any]) -> Any:
    """One miles ``Sample`` generated on the engine behind ``args.sglang_router_*``; the
    same sample comes back with tokens, response, log probs, loss mask and status filled
    by miles' ``update_sample_from_response``."""
    tok = run_tokenizer(args)
    if sample.tokens:
        ids = [int(t) for t in sample.tokens]
    elif isinstance(sample.prompt, str):
        ids = list(tok.encode(sample.prompt))
    else:
        raise TypeError(
            "adapters.miles.generate needs a text prompt or sample.tokens; got a prompt of "
            f"type {type(sample.prompt).__name__}"
        )
    if sample.response_length:  # a resumed (aborted) sample: what is left of the budget
        params = {**params, "max_new_tokens": params["max_new_tokens"] - sample.response_length}
    payload, status = _endpoint.compute_request_payload(
        args, ids, params, multimodal_inputs=sample.multimodal_inputs
    )
    if payload is None:  # no room left for a response
        sample.status = status
        return sample
    output = await get_client(engine_url(args)).generate_raw(payload)
    if output.get("text") is None:  # an engine started with --skip-tokenizer-init
        got = output["meta_info"].get("output_token_logprobs") or []
        output["text"] = tok.decode([int(x[1]) for x in got]) if got else ""
    await _endpoint.update_sample_from_response(
        args, sample, payload, output, update_loss_mask=True
    )
    return sample


def eval_groups(args: Any) -> tuple[list[list[Any]], list[str]] | None:
    """``--eval-prompt-data NAME PATH ...`` as groups of ``--n-samples-per-eval-prompt``
    samples, with each group's set name; None without the flag. The rows are read as the
    training prompts are (``adapters.common.prompt_source``: miles' ``Dataset`` imports
    sglang): ``--eval-input-key`` / ``--eval-label-key``, else the rollout's keys, and the
    chat template as for training."""
    from adapters.common.config import titan_config_from_args
    from titan_rl.data import load_file_prompts

    pairs = list(args.eval_prompt_data or [])
    if not pairs:
        return None
    base = titan_config_from_args(args).data
    groups: list[list[Any]] = []
    names: list[str] = []
    index = 0
    for name, path in zip(pairs[::2], pairs[1::2], strict=True):
        cfg = base.model_copy(update={
            "type": "parquet" if str(path).endswith(".parquet") else "jsonl", "path": path,
            "prompt_key": args.eval_input_key or args.input_key,
            "label_key": args.eval_label_key or args.label_key,
            "apply_chat_template": bool(args.apply_chat_template),
        })  # fmt: skip
        for p in load_file_prompts(path, cfg, f"--eval-prompt-data {name}").prompts:
            group = []
            for _ in range(args.n_samples_per_eval_prompt):
                group.append(_types.Sample(
                    index=index, prompt=p.text, label=p.label, metadata=dict(p.metadata)
                ))  # fmt: skip
                index += 1
            groups.append(group)
            names.append(name)
    return groups, names


def generate_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> SimpleNamespace:
    """One rollout's sample groups (``samples``, ``metrics``), or with ``evaluation`` the
    eval sets (:func:`eval_groups`, else the source's ``eval_samples()``) at the
    ``--eval-*`` sampling settings (``data``, ``metrics``)."""
    hub = import_peer("miles.rollout.rm_hub")
    rm = hub.batched_async_rm if args.group_rm else hub.async_rm
    named = eval_groups(args) if evaluation else None
    groups = rollout_groups(
        args, data_source, evaluation, generate, rm, eval_groups=named[0] if named else None
    )
    flat = [s for g in groups for s in g]
    metrics = summary(args, flat, evaluation, _types.Sample.Status.TRUNCATED)
    if not evaluation:
        return SimpleNamespace(samples=groups, metrics=metrics)
    data = eval_data(args, groups, named[1] if named else None, metrics)
    return SimpleNamespace(data=data, metrics=metrics)
