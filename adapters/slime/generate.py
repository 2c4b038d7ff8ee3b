"""A generate hook for slime's ``--custom-generate-function-path``, through Titan's client.

``--custom-generate-function-path adapters.slime.generate.generate`` makes slime's rollout send
each sample to ``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`` (the
router or engine slime's own generate uses) with :class:`titan_rl.rollout.SGLangClient`:
connection pooling, retries with a fixed ``rid`` on connection errors and 5xx, and clear
errors on 4xx. The sample is filled as slime's default generate fills it, through slime's own
``Sample.append_response_tokens``: ``tokens`` (prompt + response ids), ``response``,
``response_length``, ``rollout_log_probs``, ``loss_mask``, ``status`` from the finish reason,
``weight_versions`` and the prefix-cache / routed-expert / top-p data the engine reports.

Prompt ids: ``sample.tokens`` when set (a resumed partial sample carries prompt + earlier
response there), else ``sample.prompt`` tokenized with ``add_special_tokens=False`` by
the Titan run's tokenizer (``data.tokenizer_*`` of ``TITAN_CONFIG``) or else Titan's HF
tokenizer of ``args.hf_checkpoint`` (its ``tokenizer.json``). Input ids are always
sent, so the engine may run with ``--skip-tokenizer-init``; then the response text is decoded
here (special tokens skipped, whatever ``skip_special_tokens`` says).

Partial rollout: an ABORTED sample resumes as in slime: generation continues from
``sample.tokens`` with ``max_new_tokens`` reduced by ``response_length``, and the new tokens,
log probs and text are appended. Not supported: multimodal inputs (raise), slime's
``X-SMG-Routing-Key`` header for consistent-hashing routers (requests are not pinned to a
worker).
"""

from __future__ import annotations

from typing import Any

from adapters.common.clients import aclose_clients, engine_url, get_client, run_tokenizer
from titan_rl.rollout.client import GenerateOutput, SGLangError

__all__ = ["aclose_clients", "engine_url", "generate", "get_client"]


def _prompt_ids(args: Any, sample: Any) -> list[int]:
    if sample.tokens:
        return [int(t) for t in sample.tokens]
    if not isinstance(sample.prompt, str):
        raise TypeError(
            "adapters.slime.generate needs a text prompt (apply the chat template in the data "
            f"pipeline) or sample.tokens; got prompt of type {type(sample.prompt).__name__}"
        )
    return list(run_tokenizer(args, "tokenize the prompt").encode(sample.prompt))


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """Generate ``sample``'s response on slime's rollout engine; returns the same Sample.

    ``sampling_params`` is the SGLang dict slime builds (``max_new_tokens`` counts the whole
    response, so a resumed sample gets what is left); it is not modified.
    """
    from adapters.peers import import_peer

    status = import_peer("slime.utils.types").Sample.Status
    if sample.status not in (status.PENDING, status.ABORTED):
        raise ValueError(f"can only generate a PENDING or ABORTED sample, not {sample.status}")
    inputs = sample.multimodal_inputs or {}
    if any(v is not None for v in inputs.values()):
        raise NotImplementedError("adapters.slime.generate does not send multimodal inputs")

    params = dict(sampling_params)
    params["max_new_tokens"] = int(params["max_new_tokens"]) - sample.response_length
    if params["max_new_tokens"] < 0:
        raise ValueError(
            f"the sample already has {sample.response_length} response tokens, more than "
            f"max_new_tokens={sampling_params['max_new_tokens']}"
        )
    if params["max_new_tokens"] == 0:
        sample.status = status.TRUNCATED
        return sample

    prompt_ids = _prompt_ids(args, sample)
    extra: dict[str, Any] = {}
    if getattr(args, "use_rollout_routing_replay", False):
        extra["return_routed_experts"] = True
    out = await get_client(engine_url(args)).generate(
        prompt_ids, params, return_logprob=True, **extra
    )
    if not isinstance(out, GenerateOutput):
        raise ValueError("sampling_params['n'] > 1 is not supported: slime sends one per sample")
    if out.output_ids and (
        out.output_logprobs is None or len(out.output_logprobs) != len(out.output_ids)
    ):
        raise SGLangError(f"{engine_url(args)}/generate returned no output_token_logprobs")

    text = out.text
    if text is None:
        text = (
            run_tokenizer(args, "decode the response").decode(out.output_ids)
            if out.output_ids
            else ""
        )
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    sample.append_response_tokens(
        args,
        tokens=out.output_ids,
        log_probs=out.output_logprobs or [],
        trainable=True,
        meta_info=out.meta_info,
        text=text,
    )
    return sample
