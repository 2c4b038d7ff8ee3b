"""The request models (no server): SGLang's GenerateReqInput read as SGLang reads it, every
rejection naming the field (with the prompt's index in a batch)."""

from __future__ import annotations

import random

import pytest

from titan_rl.engine.io_struct import (
    MAX_SEQUENCES,
    AbortReq,
    GenerateReqInput,
    ReleaseMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    parse_request,
)
from titan_rl.engine.sampling import SamplingParams
from titan_rl.engine.validation import RequestError

VOCAB = 300


def gen(data: dict) -> GenerateReqInput:
    return parse_request(GenerateReqInput, data, VOCAB)


def rejection(model: type, data: dict) -> str:
    with pytest.raises(RequestError) as err:
        parse_request(model, data, VOCAB)
    return str(err.value)


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_spreads_single_values_over_its_prompts(seed: int) -> None:
    rng = random.Random(seed)
    count = rng.randint(2, 9)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(count)]
    temps = [rng.choice([0.0, 0.5, 1.0]) for _ in range(count)]
    req = gen(
        {
            "input_ids": prompts,
            "sampling_params": [{"temperature": t} for t in temps],
            "return_logprob": True,
            "rid": [f"r{i}" for i in range(count)],
            "stream": None,  # null is unset, as in SGLang's dataclass
            "return_text_in_logprobs": True,  # an SGLang key this engine ignores
        }
    )
    assert req.is_batch and req.num_prompts == count and not req.single_response
    assert [p.temperature for p in req.per_prompt("sampling_params")] == temps
    assert req.per_prompt("return_logprob") == [True] * count
    assert req.per_prompt("logprob_start_len") == [-1] * count
    assert req.per_prompt("rid") == [f"r{i}" for i in range(count)]
    assert req.stream is False


def test_one_prompt_is_one_response_unless_it_has_copies() -> None:
    one = gen({"input_ids": [5, 6, 7]})
    assert not one.is_batch and one.num_prompts == 1 and one.single_response
    assert one.per_prompt("sampling_params") == [SamplingParams()]
    copies = gen({"input_ids": [5, 6, 7], "sampling_params": {"n": 3}})
    assert not copies.single_response
    assert gen({"text": ["a", "b"]}).num_prompts == 2


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"input_ids": 5}, "input_ids"),
        ({"input_ids": "1 2 3"}, "input_ids"),
        ({"input_ids": [1, "2"]}, "input_ids"),
        ({"input_ids": [[1], 2]}, "input_ids"),
        ({"input_ids": [True, 1]}, "input_ids"),  # a boolean is not a token id
        ({"input_ids": [1.0]}, "input_ids"),
        ({"text": 5}, "text"),
        ({"text": []}, "text"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        (
            {"input_ids": [1], "sampling_params": {"temperature": -0.5}},
            "sampling_params.temperature",
        ),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),
        ({"input_ids": [1], "sampling_params": {"logit_bias": {str(VOCAB): 1}}}, "logit_bias"),
        ({"input_ids": [1], "sampling_params": "greedy"}, "sampling_params"),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{}, {"top_k": -2}]},
            "sampling_params[1].top_k",
        ),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
        ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
        ({"input_ids": [1], "return_logprob": 1}, "return_logprob"),
        ({"input_ids": [1], "logprob_start_len": "0"}, "logprob_start_len"),
        ({"input_ids": [1], "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"input_ids": [[1], [2]], "top_logprobs_num": [1, 2, 3]}, "top_logprobs_num"),
        ({"input_ids": [1], "rid": 5}, "rid"),
        ({"input_ids": [[1], [2]], "rid": "one"}, "rid"),
        ({"input_ids": [1], "stream": "yes"}, "stream"),
        ({"input_ids": [1], "input_embeds": [[0.5]]}, "input_embeds"),
        ({"input_ids": [1], "image_data": "img.png"}, "image_data"),
        ({"input_ids": [1], "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": [1], "token_ids_logprob": [3]}, "token_ids_logprob"),
        ({}, "'text' or 'input_ids'"),
        ({"text": "hi", "input_ids": [1]}, "'text' or 'input_ids'"),
    ],
)
def test_a_bad_generate_request_names_the_field(data: dict, names: str) -> None:
    assert names in rejection(GenerateReqInput, data)


def test_all_problems_are_reported_at_once() -> None:
    message = rejection(
        GenerateReqInput,
        {"input_ids": [[1], [2]], "sampling_params": [{"top_k": 0}, {"top_p": 2}], "rid": 7},
    )
    for field in ("sampling_params[0].top_k", "sampling_params[1].top_p", "rid"):
        assert field in message, message


def test_a_request_holds_a_bounded_number_of_sequences() -> None:
    n = 128
    prompts = MAX_SEQUENCES // n
    ok = gen({"input_ids": [[1]] * prompts, "sampling_params": {"n": n}})
    assert sum(p.n for p in ok.per_prompt("sampling_params")) == MAX_SEQUENCES
    assert "at most" in rejection(
        GenerateReqInput, {"input_ids": [[1]] * (prompts + 1), "sampling_params": {"n": n}}
    )


def test_values_are_not_coerced() -> None:
    """As the hand validation did: ``"1"`` is not an int, ``1`` not a boolean."""
    assert "model_path" in rejection(UpdateWeightFromDiskReqInput, {"model_path": 5})
    assert "n" in rejection(GenerateReqInput, {"input_ids": [1], "top_logprobs_num": "1"})
    assert "abort_all" in rejection(AbortReq, {"abort_all": 1})
    assert "missing required field 'model_path'" in rejection(
        UpdateWeightFromDiskReqInput, {"model_path": None}
    )
    assert "give 'rid'" in rejection(AbortReq, {})
    assert "tags" in rejection(ReleaseMemoryOccupationReqInput, {"tags": ["gpu"]})
    assert parse_request(ReleaseMemoryOccupationReqInput, {"tags": None}, VOCAB).tags is None


def test_a_long_value_is_cut_short_in_the_message() -> None:
    message = rejection(GenerateReqInput, {"input_ids": list(range(10_000)) + ["x"]})
    assert "input_ids" in message and len(message) < 300
