"""slime's reward and generate hooks (adapters.slime.rewards / .generate), loaded with slime's
own ``load_function`` and called as slime's rollout calls them, with slime's ``Sample``, against
Titan's built-in engine on 127.0.0.1 (started with --skip-tokenizer-init, so the hook tokenizes
and decodes itself)."""

from __future__ import annotations

import asyncio
import copy
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("slime", reason="slime is installed from ../shared/peers (make test)")

from slime.utils.misc import load_function  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

from titan_rl.actors.config import EngineServerConfig  # noqa: E402
from titan_rl.actors.server import ServerProcess  # noqa: E402

VOCAB = 300
WEIGHT_VERSION = "v7"


def _make_model_dir(path: Path) -> Path:
    """The tiny random llama of tests/rollout/conftest.py plus a word-level tokenizer whose
    token i is the word ``w{i}`` (0-2 special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.rollout.conftest import VOCAB as MODEL_VOCAB
    from tests.rollout.conftest import make_tiny_model

    assert MODEL_VOCAB == VOCAB
    make_tiny_model(path, "llama")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_model_dir(tmp_path_factory.mktemp("slime-hooks-model"))


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(
        EngineServerConfig(
            model_path=str(model_dir),
            backend="builtin",
            num_threads=1,
            skip_tokenizer_init=True,
            weight_version=WEIGHT_VERSION,
            log_dir=str(tmp_path_factory.mktemp("slime-hooks-logs")),
            startup_timeout_s=120,
        ),
        name="slime-hooks-engine",
    )
    server.start()
    yield server
    server.stop()


def slime_args(**kw: Any) -> Namespace:
    """The slime arguments the hooks read (slime's parser defaults for the rest)."""
    base = dict(
        sglang_router_ip="127.0.0.1",
        sglang_router_port=0,
        hf_checkpoint=None,
        use_rollout_routing_replay=False,
        rollout_stop=None,
        sglang_speculative_algorithm=None,
    )
    return Namespace(**{**base, **kw})


def sampling_params(max_new_tokens: int, **kw: Any) -> dict[str, Any]:
    """The dict slime's GenerateState builds, at temperature 0 (greedy)."""
    return dict(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=max_new_tokens,
        stop=None,
        stop_token_ids=None,
        skip_special_tokens=False,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
        **kw,
    )


def engine_generate(url: str, input_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """The engine's own /generate answer to the same request."""
    payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
    resp = httpx.post(url + "/generate", json=payload, timeout=60)
    resp.raise_for_status()
    return resp.json()


# ---- rewards ------------------------------------------------------------------------------


def test_exact_match_single_and_batched() -> None:
    rm = load_function("adapters.slime.rewards.exact_match")
    args = slime_args(rollout_stop=["###"])

    def sample(response: str, label: str | None) -> Sample:
        return Sample(prompt="What is 1+1?", response=response, label=label)

    right = [sample("2\nbecause 1+1=2", "2"), sample(" 2 <|im_end|>junk", "2"), sample("2###", "2")]
    wrong = [sample("3", "2"), sample("", "2"), sample("2", None), sample("22", "2")]
    for s in right:
        assert asyncio.run(rm(args, s)) == 1.0, s.response
    for s in wrong:
        assert asyncio.run(rm(args, s)) == 0.0, s.response
    # --rollout-stop strings count only when slime was given them
    assert asyncio.run(rm(slime_args(), sample("2###", "2"))) == 0.0
    # --group-rm: slime awaits the same hook with the whole group
    assert asyncio.run(rm(args, right[:2] + wrong[:2])) == [1.0, 1.0, 0.0, 0.0]
    batch_rm = load_function("adapters.slime.rewards.exact_match_batch")
    assert asyncio.run(batch_rm(args, [right[0], wrong[0]])) == [1.0, 0.0]
    with pytest.raises(TypeError, match="list of samples"):
        asyncio.run(batch_rm(args, right[0]))


def test_math_verify_boxed_and_off_the_event_loop() -> None:
    rm = load_function("adapters.slime.rewards.math_verify")
    args = slime_args()
    half = Sample(prompt="p", response="So the answer is \\boxed{\\frac{1}{2}}.", label="0.5")
    wrong = Sample(prompt="p", response="\\boxed{\\frac{1}{3}}", label="0.5")
    unlabelled = Sample(prompt="p", response="\\boxed{1}", label=None)

    async def main() -> tuple[float, list[float], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        seen = ticks
        one = await rm(args, half)  # not textually equal: math-verify itself decides
        ticks_during = ticks - seen
        many = await rm(args, [half, wrong, unlabelled])
        task.cancel()
        return one, many, ticks_during

    one, many, ticks_during = asyncio.run(main())
    assert one == 1.0
    assert many == [1.0, 0.0, 0.0]
    assert ticks_during > 0  # the loop kept running while math-verify worked


# ---- generate -----------------------------------------------------------------------------


def test_generate_fills_sample_like_slime(engine: ServerProcess, model_dir: Path) -> None:
    gen = load_function("adapters.slime.generate.generate")
    from adapters.slime import generate as hook_module

    args = slime_args(sglang_router_port=engine.port, hf_checkpoint=str(model_dir))
    params = sampling_params(8)
    ref = engine_generate(engine.url, [5, 6, 7], params)
    ref_ids = ref["output_ids"]
    ref_lps = [t[0] for t in ref["meta_info"]["output_token_logprobs"]]
    ref_status = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED}[
        ref["meta_info"]["finish_reason"]["type"]
    ]

    async def main() -> tuple[Sample, Sample, bool]:
        # a text prompt: tokenized from args.hf_checkpoint, ids sent to the engine
        s = Sample(prompt="w5 w6 w7", label="x")
        sent = copy.deepcopy(params)
        out = await gen(args, s, sent)
        assert sent == params  # slime's dict is left as it was
        # prompt ids given: sample.tokens is used as is
        t = await gen(args, Sample(prompt="ignored", tokens=[5, 6, 7]), dict(params))
        same = hook_module.get_client(hook_module.engine_url(args)) is hook_module.get_client(
            f"http://127.0.0.1:{engine.port}"
        )
        await hook_module.aclose_clients()
        return out, t, same

    out, from_tokens, same_client = asyncio.run(main())
    assert same_client
    assert out.tokens == [5, 6, 7, *ref_ids]
    assert out.response_length == len(ref_ids) == len(out.rollout_log_probs) > 0
    assert out.rollout_log_probs == pytest.approx(ref_lps, abs=1e-5)
    assert out.loss_mask == [1] * len(ref_ids)
    assert out.status == ref_status
    assert out.weight_versions == [WEIGHT_VERSION]
    assert out.response == " ".join(f"w{t}" for t in ref_ids if t > 2)
    assert out.prefix_cache_info.total_prompt_tokens == 3
    assert from_tokens.tokens == out.tokens
    assert from_tokens.rollout_log_probs == pytest.approx(ref_lps, abs=1e-5)

    # the generated sample goes on to the reward hook, as in slime's generate_and_rm
    rm = load_function("adapters.slime.rewards.exact_match")
    out.label = out.response
    assert asyncio.run(rm(args, out)) == (1.0 if out.response.strip() else 0.0)
    out.label = "w999"
    assert asyncio.run(rm(args, out)) == 0.0


def test_generate_resumes_a_partial_sample(engine: ServerProcess, model_dir: Path) -> None:
    gen = load_function("adapters.slime.generate.generate")
    from adapters.slime import generate as hook_module

    args = slime_args(sglang_router_port=engine.port, hf_checkpoint=str(model_dir))
    full = engine_generate(engine.url, [8, 9, 10], sampling_params(8, ignore_eos=True))
    full_ids = full["output_ids"]
    full_lps = [t[0] for t in full["meta_info"]["output_token_logprobs"]]

    async def main() -> tuple[Sample, Sample]:
        s = Sample(prompt="w8 w9 w10")
        s = await gen(args, s, sampling_params(3, ignore_eos=True))
        first = copy.deepcopy(s)
        s.status = Sample.Status.ABORTED  # as slime's abort leaves a partial sample
        s = await gen(args, s, sampling_params(8, ignore_eos=True))
        # nothing left to generate: TRUNCATED without a request
        done = Sample(tokens=[8, 9], response_length=2, status=Sample.Status.ABORTED)
        done = await gen(args, done, sampling_params(2))
        assert done.status == Sample.Status.TRUNCATED and done.tokens == [8, 9]
        await hook_module.aclose_clients()
        return first, s

    first, resumed = asyncio.run(main())
    assert first.status == Sample.Status.TRUNCATED and first.response_length == 3
    assert resumed.tokens == [8, 9, 10, *full_ids]
    assert resumed.response_length == 8 == len(resumed.rollout_log_probs)
    assert resumed.rollout_log_probs == pytest.approx(full_lps, abs=1e-4)
    assert resumed.loss_mask == [1] * 8
    assert resumed.status == Sample.Status.TRUNCATED
    assert resumed.weight_versions == [WEIGHT_VERSION, WEIGHT_VERSION]
    assert resumed.response.startswith(first.response)

    with pytest.raises(ValueError, match="PENDING or ABORTED"):
        asyncio.run(gen(args, resumed, sampling_params(8)))
