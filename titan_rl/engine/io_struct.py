"""Request bodies of SGLang's native HTTP API (names from ``sglang/srt/managers/io_struct.py``).

Validated as SGLang reads them (unknown top-level keys ignored, ``null`` = unset) but without
type coercion; what the built-in engine cannot serve is rejected with the reason. Checks that
need the served model (vocabulary, context length, tokenizer) use the validation context
or happen where the sequences are built (:mod:`titan_rl.engine.routes.generate`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from titan_rl.engine.memory import MEMORY_TAGS
from titan_rl.engine.sampling import UNKNOWN_SAMPLING_PARAMETER, SamplingParams
from titan_rl.engine.validation import EACH, ONE, RequestModel, invalid, on_error, parse

#: sequences (prompts x n) one /generate request may hold
MAX_SEQUENCES = 4096

T = TypeVar("T")
M = TypeVar("M", bound=RequestModel)

NonEmpty = Annotated[list[T], Field(min_length=1)]
TokenIds = list[int]
#: one value for every prompt, or a list of one per prompt
PerPrompt = T | list[T]
#: the fields :meth:`GenerateReqInput.per_prompt` spreads over the prompts
_PER_PROMPT = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")

Text = Annotated[str | NonEmpty[str], on_error("must be a string or a non-empty list of strings")]
InputIds = Annotated[
    TokenIds | NonEmpty[TokenIds],
    on_error("must be a list of token ids or a non-empty list of such lists"),
]
Rid = Annotated[str | list[str], on_error("must be a string or a list of strings")]
#: a weight version: SGLang takes a string, a number is accepted and kept as its string
Version = Annotated[str | int, on_error("must be a string or an integer")]


def _one_or_each(value: Any) -> str | None:
    if isinstance(value, dict):
        return ONE
    return EACH if isinstance(value, list) else None


SamplingParamsInput = Annotated[
    Annotated[SamplingParams, Tag(ONE)] | Annotated[list[SamplingParams], Tag(EACH)],
    Discriminator(
        _one_or_each,
        custom_error_type="object_type",
        custom_error_message="must be a JSON object, or a list of one per prompt",
    ),
]


class GenerateReqInput(RequestModel):
    """``POST /generate``: one prompt (``text`` str or ``input_ids`` list[int]) or a batch."""

    text: Text | None = None
    input_ids: InputIds | None = None
    sampling_params: SamplingParamsInput = Field(default_factory=SamplingParams)
    rid: Rid | None = None
    stream: Annotated[bool, on_error("must be true or false")] = False
    return_logprob: Annotated[
        PerPrompt[bool], on_error("must be a boolean or a list of one per prompt")
    ] = False
    logprob_start_len: Annotated[
        PerPrompt[int], on_error("must be an integer or a list of one per prompt")
    ] = -1
    top_logprobs_num: Annotated[
        PerPrompt[Annotated[int, Field(ge=0)]],
        on_error("must be an integer >= 0 or a list of one per prompt"),
    ] = 0
    #: R3: each token's experts in every MoE layer, in ``meta_info["routed_experts"]`` (base64
    #: int32 ``[tokens, num_layers, top_k]``); a dense model answers 400
    return_routed_experts: Annotated[bool, on_error("must be true or false")] = False
    #: the first token whose experts are returned: the answer covers tokens
    #: ``[routed_experts_start_len, seqlen - 1)``; at most the prompt's length
    routed_experts_start_len: Annotated[
        Annotated[int, Field(ge=0)], on_error("must be an integer >= 0")
    ] = 0
    # SGLang's fields the built-in engine does not serve: rejected when given
    input_embeds: Any = None
    token_ids_logprob: Any = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    lora_path: Any = None

    @field_validator("input_embeds")
    @classmethod
    def _no_embeds(cls, v: Any) -> Any:
        raise invalid("not supported by the built-in CPU engine; send input_ids")

    @field_validator("token_ids_logprob")
    @classmethod
    def _no_token_ids_logprob(cls, v: Any) -> Any:
        raise invalid("not supported by the built-in CPU engine")

    @field_validator("image_data", "audio_data", "video_data", "lora_path")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v:
            raise invalid("not supported by the built-in CPU engine")
        return v

    @model_validator(mode="after")
    def _one_prompt_source_and_matching_lists(self) -> Self:
        if (self.text is None) == (self.input_ids is None):
            raise invalid("give exactly one of 'text' or 'input_ids'")
        count = self.num_prompts
        for name in _PER_PROMPT:
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != count:
                raise invalid(f"{name} has {len(value)} entries for {count} prompts")
        if isinstance(self.rid, str) and count > 1:
            raise invalid("a batch needs one rid per prompt (a list)")
        total = sum(p.n for p in self.per_prompt("sampling_params"))
        if total > MAX_SEQUENCES:
            raise invalid(f"a request may hold at most {MAX_SEQUENCES} sequences, got {total}")
        return self

    @property
    def is_batch(self) -> bool:
        """Whether the prompts came as a list (``text`` list, ``input_ids`` list of lists)."""
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def prompts(self) -> list[Any]:
        """The prompts (strings, or lists of token ids) as a list, one per prompt."""
        given = self.text if self.text is not None else self.input_ids
        return given if self.is_batch else [given]  # type: ignore[return-value]

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def single_response(self) -> bool:
        """One prompt with n = 1 is answered with an object; everything else with a list."""
        return not self.is_batch and all(p.n == 1 for p in self.per_prompt("sampling_params"))

    def per_prompt(self, name: str) -> list[Any]:
        """Field ``name`` as one value per prompt (a single value applies to all)."""
        value = getattr(self, name)
        return value if isinstance(value, list) else [value] * self.num_prompts


class UpdateWeightFromDiskReqInput(RequestModel):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: Version | None = None


class UpdateWeightsFromTensorReqInput(RequestModel):
    serialized_named_tensors: list[Any]
    load_format: str | None = None
    weight_version: Version | None = None


class InitWeightsUpdateGroupReqInput(RequestModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(RequestModel):
    names: list[Any]
    dtypes: list[Any]
    shapes: list[Any]
    group_name: str = "weight_update_group"
    load_format: str | None = None
    weight_version: Version | None = None


class DestroyWeightsUpdateGroupReqInput(RequestModel):
    group_name: str = "weight_update_group"


class UpdateWeightVersionReqInput(RequestModel):
    new_version: Version


class GetWeightsByNameReqInput(RequestModel):
    name: str
    truncate_size: int = 100


class PauseGenerationReqInput(RequestModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(RequestModel):
    """Takes ``{}`` (any keys are ignored)."""


class AbortReq(RequestModel):
    rid: str = ""
    abort_all: bool = False

    @model_validator(mode="after")
    def _something_to_abort(self) -> Self:
        if not self.rid and not self.abort_all:
            raise invalid("give 'rid' or set 'abort_all': true")
        return self


MemoryTags = Annotated[
    list[Literal[MEMORY_TAGS]],  # type: ignore[valid-type]
    on_error("must be null or a list of 'weights', 'kv_cache', 'cuda_graph'"),
]


class ReleaseMemoryOccupationReqInput(RequestModel):
    tags: MemoryTags | None = None  # None: all of them


class ResumeMemoryOccupationReqInput(RequestModel):
    tags: MemoryTags | None = None  # None: all of them


def parse_request(model: type[M], data: Any, vocab_size: int) -> M:
    """Validate a request body; raise RequestError naming each bad field."""
    return parse(
        model, data, context={"vocab_size": vocab_size}, unknown=UNKNOWN_SAMPLING_PARAMETER
    )
