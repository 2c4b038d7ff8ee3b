"""Chunked prefill (``--chunked-prefill-size``): a long prompt is prefilled a chunk per
scheduler iteration, between the running requests' decode steps, so a short request from
another client is answered while the long one is still prefilling; the chunked prompt's
tokens, logprobs and routed experts equal an unchunked prefill's (and HF's own forward).

The ordering tests use progress evidence (how far the long prompt had got when the short
request finished), never wall-clock thresholds."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from titan_rl.engine.core import Engine, Sequence, sequence_result
from titan_rl.engine.sampling import parse_sampling_params

VOCAB = 300
LONG = 2000  # prompt tokens of the long request (a tiny model: milliseconds a chunk)
CHUNK = 64
TOL = 1e-5  # fp32


def _long_context_model(make_model: Callable[..., Path], path: Path, family: str) -> Path:
    """A tiny random model whose context holds the long prompts."""
    make_model(path, family)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, make_model) -> Path:
    return _long_context_model(make_model, tmp_path_factory.mktemp("llama-4k"), "llama")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory, make_model) -> Path:
    return _long_context_model(make_model, tmp_path_factory.mktemp("moe-4k"), "qwen3_moe")


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _seq(eng: Engine, prompt: list[int], rid: str, max_new: int, **kw: Any) -> Sequence:
    params = parse_sampling_params(
        {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}, VOCAB
    )
    return eng.make_sequence(prompt, params, rid=rid, **kw)


def _set_paused(eng: Engine, paused: bool) -> None:
    eng.call(lambda: setattr(eng, "paused", paused)).result(timeout=30)


def _step(eng: Engine) -> None:
    """One scheduler iteration (prefill budget, then the decode step), on the engine thread
    of a paused engine: the test decides what happens between iterations."""

    def run() -> None:
        eng._prefill_step()
        if eng.active:
            eng._decode_step()

    eng.call(run).result(timeout=60)


def test_short_request_finishes_while_a_long_prompt_prefills(llama: Path) -> None:
    """The long prompt is queued first; the short one still finishes before the long one has
    its first token, and a sequence already decoding keeps decoding meanwhile."""
    eng = Engine(str(llama), num_threads=1, chunked_prefill_size=CHUNK)
    seen: dict[str, Any] = {}
    done = threading.Event()

    def on_done(s: Sequence) -> None:
        seen[s.rid] = {
            "long_output": len(long.output_ids),
            "long_chunks": eng.prefill_chunks,
            "decoder_output": len(decoder.output_ids),
        }
        if len(seen) == 3:
            done.set()

    try:
        _set_paused(eng, True)
        decoder = _seq(eng, _prompt(8, 1), "decoder", 20, on_done=on_done)
        long = _seq(eng, _prompt(LONG, 2), "long", 2, on_done=on_done)
        short = _seq(eng, _prompt(4, 3), "short", 4, on_done=on_done)
        for s in (decoder, long, short):  # one request each, in this order
            eng.submit([s])
        _set_paused(eng, False)
        assert done.wait(120), "the engine did not finish the requests"
        # the short request was answered before the long prompt's prefill ended ...
        assert seen["short"]["long_output"] == 0
        assert seen["short"]["long_chunks"] < LONG // CHUNK
        # ... and so was the 20-token decoder admitted just before it
        assert seen["decoder"]["long_output"] == 0
        assert long.finish_reason == {"type": "length", "length": 2}
        assert short.finish_reason == {"type": "length", "length": 4}
        assert eng.prefill_chunks >= LONG // CHUNK  # the long prompt went in chunks
        assert eng.runner.partial == {}  # no partial cache left behind
    finally:
        eng.shutdown()


def _generate(eng: Engine, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``specs`` (prompt, max_new, logprob_start_len, routed) submitted together (while
    paused, so that every engine sees the same queue); results in order."""
    results: dict[str, dict[str, Any]] = {}
    done = threading.Event()

    def on_done(s: Sequence) -> None:
        results[s.rid] = sequence_result(s)
        if len(results) == len(specs):
            done.set()

    _set_paused(eng, True)
    for i, spec in enumerate(specs):
        seq = _seq(
            eng,
            spec["prompt"],
            f"r{i}",
            spec.get("max_new", 5),
            return_logprob=True,
            logprob_start_len=spec.get("logprob_start_len", 0),
            return_routed_experts=spec.get("routed", False),
            on_done=on_done,
        )
        eng.submit([seq])
    _set_paused(eng, False)
    assert done.wait(120), "the engine did not finish the requests"
    return [results[f"r{i}"] for i in range(len(specs))]


def _logprobs(out: dict[str, Any]) -> list[float | None]:
    meta = out["meta_info"]
    return [lp for lp, _, _ in meta["input_token_logprobs"] + meta["output_token_logprobs"]]


def _close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and abs(x - y) < TOL)
        for x, y in zip(a, b, strict=True)
    )


def _mixed_specs() -> list[dict[str, Any]]:
    """Prompts longer than a chunk, equal-length ones (prefilled as one group of rows, chunked
    together), short ones, and input logprobs from the start, mid-prompt or none."""
    return [
        {"prompt": _prompt(700, 10), "logprob_start_len": 0},
        {"prompt": _prompt(20, 11), "logprob_start_len": 3},
        {"prompt": _prompt(45, 12), "logprob_start_len": 0},
        {"prompt": _prompt(45, 13), "logprob_start_len": 30},
        {"prompt": _prompt(45, 14), "logprob_start_len": 44},
        {"prompt": _prompt(300, 15), "logprob_start_len": 130, "max_new": 8},
        {"prompt": _prompt(5, 16), "logprob_start_len": 5},
    ]


def test_chunked_prefill_equals_unchunked_and_hf(llama: Path) -> None:
    specs = _mixed_specs()
    chunked = Engine(str(llama), num_threads=1, chunked_prefill_size=CHUNK)
    whole = Engine(str(llama), num_threads=1, chunked_prefill_size=-1)
    try:
        got = _generate(chunked, specs)
        want = _generate(whole, specs)
        assert chunked.prefill_chunks > 700 // CHUNK + 300 // CHUNK  # chunks did run
        assert whole.prefill_chunks <= len(specs)  # one forward per prompt group
        model = whole.model
    finally:
        chunked.shutdown()
        whole.shutdown()
    for spec, a, b in zip(specs, got, want, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert _close(_logprobs(a), _logprobs(b)), spec["prompt"][:3]
        # against HF's own forward of prompt + output (no cache, no chunks)
        prompt, out = spec["prompt"], a["output_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        ref = [lp[i - 1, t].item() for i, t in enumerate(prompt + out) if i >= 1]
        start = spec["logprob_start_len"]
        ref_in = ([None] if start == 0 else []) + ref[max(start - 1, 0) : len(prompt) - 1]
        assert _close(_logprobs(a), ref_in + ref[len(prompt) - 1 :])
        assert a["meta_info"]["output_token_logprobs"][0][1] == int(
            logits[len(prompt) - 1].argmax()
        )


def test_chunked_moe_routed_experts_equal_unchunked(moe: Path) -> None:
    specs = [
        {"prompt": _prompt(400, 20), "routed": True},
        {"prompt": _prompt(90, 21), "routed": True, "logprob_start_len": 40},
    ]
    chunked = Engine(str(moe), num_threads=1, chunked_prefill_size=CHUNK)
    whole = Engine(str(moe), num_threads=1, chunked_prefill_size=-1)
    try:
        got, want = _generate(chunked, specs), _generate(whole, specs)
    finally:
        chunked.shutdown()
        whole.shutdown()
    for a, b in zip(got, want, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert _close(_logprobs(a), _logprobs(b))
        assert a["meta_info"]["routed_experts"] == b["meta_info"]["routed_experts"]


def test_abort_mid_prefill_drops_its_partial_cache(llama: Path) -> None:
    """Stepped by hand: a long prompt aborted between its chunks is gone with its partial
    cache; the requests around it give what an unchunked engine gives."""
    budget = CHUNK * 8
    specs = [{"prompt": _prompt(100, 40), "max_new": 3}, {"prompt": _prompt(150, 42), "max_new": 4}]
    eng = Engine(str(llama), num_threads=1, chunked_prefill_size=budget)
    results: dict[str, dict[str, Any]] = {}

    def on_done(s: Sequence) -> None:
        results[s.rid] = sequence_result(s)

    try:
        _set_paused(eng, True)
        first = _seq(eng, specs[0]["prompt"], "r0", 3, on_done=on_done, return_logprob=True)
        long = _seq(eng, _prompt(LONG, 41), "long", 2, on_done=on_done)
        other = _seq(eng, specs[1]["prompt"], "r1", 4, on_done=on_done, return_logprob=True)
        for s in (first, long, other):
            eng.submit([s])
        _step(eng)  # r0 whole; the long prompt does not fit what is left: it waits
        assert eng.active == [first] and eng.num_queued() == 2
        _step(eng)  # the long prompt's first chunk
        _step(eng)  # r1 whole, then the long prompt's second chunk
        assert [u.seqs for u in eng._units()] == [[long]]
        assert eng._units()[0].done == 2 * budget - 150
        assert list(eng.runner.partial) == [eng._units()[0].key]
        eng.call(lambda: eng.abort("long")).result(timeout=30)
        assert results["long"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert eng.runner.partial == {} and not eng._units()
        while len(results) < 3:
            _step(eng)
        assert eng.num_in_flight() == 0
    finally:
        eng.shutdown()
    whole = Engine(str(llama), num_threads=1, chunked_prefill_size=-1)
    try:
        want = _generate(whole, specs)
    finally:
        whole.shutdown()
    for rid, ref in zip(("r0", "r1"), want, strict=True):
        assert results[rid]["output_ids"] == ref["output_ids"]
        got = [lp for lp, _, _ in results[rid]["meta_info"]["output_token_logprobs"]]
        assert _close(got, [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]])


def test_runner_drops_rows_between_chunks(llama: Path) -> None:
    """The runner's partial cache of a group of rows: rows dropped between chunks (an aborted
    sequence's), the rest finish as a one-forward prefill of their prompts would."""
    from titan_rl.engine.runner import build_runner, load_model
    from titan_rl.engine.tp.comm import Comm

    runner = build_runner(load_model(str(llama), "float32"), 0, 1, Comm())
    prompts = torch.tensor([_prompt(90, 70 + i) for i in range(3)])
    with torch.inference_mode():
        runner.prefill(0, prompts[:, :50], 90, 1, False)
        logits, _ = runner.prefill(0, prompts[[0, 2], 50:], 90, 40, False, rows=[0, 2])
        runner.keep_prefill(0, [0, 1])
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        step, _ = runner.decode(nxt, False)
        ref = runner.model(torch.cat([prompts[[0, 2]], nxt], dim=1)).logits
    assert runner.partial == {} and runner.cache.layers[0].keys.shape[:3] == (2, 2, 91)
    assert (logits - ref[:, 50:90]).abs().max() < TOL
    assert (step - ref[:, -1]).abs().max() < TOL


def test_http_short_client_answered_before_long_prompt_over_the_cli(
    llama: Path, engine_factory
) -> None:
    """``python -m titan_rl.engine --chunked-prefill-size 64``: one client's 2,000-token prompt
    (one output token: its response comes right after its prefill) and another client's
    4-token request, both queued while paused; the short response comes first."""
    server = engine_factory(llama, "chunked", extra_args=["--chunked-prefill-size", str(CHUNK)])

    async def run() -> list[str]:
        order: list[str] = []
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=120) as a,
            httpx.AsyncClient(base_url=server.url, timeout=120) as b,
        ):
            assert (await a.post("/pause_generation", json={"mode": "in_place"})).status_code == 200

            async def gen(client: httpx.AsyncClient, name: str, ids: list[int], n: int) -> None:
                r = await client.post(
                    "/generate",
                    json={
                        "input_ids": ids,
                        "sampling_params": {
                            "max_new_tokens": n,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    },
                )
                assert r.status_code == 200, r.text
                assert len(r.json()["output_ids"]) == n
                order.append(name)

            long = asyncio.create_task(gen(a, "long", _prompt(LONG, 60), 1))
            while (await b.get("/get_server_info")).json()["num_queued_reqs"] < 1:
                await asyncio.sleep(0.01)
            short = asyncio.create_task(gen(b, "short", _prompt(4, 61), 4))
            while (await b.get("/get_server_info")).json()["num_queued_reqs"] < 2:
                await asyncio.sleep(0.01)
            assert (await b.post("/continue_generation", json={})).status_code == 200
            await asyncio.gather(long, short)
        return order

    assert asyncio.run(run()) == ["short", "long"]


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_cli_rejects_a_bad_chunk_size(llama: Path, bad: str) -> None:
    from titan_rl.engine.cli import build_parser, validate

    args = build_parser().parse_args(["--model-path", str(llama), "--chunked-prefill-size", bad])
    with pytest.raises(SystemExit, match="chunked-prefill-size"):
        validate(args)


def test_config_key_reaches_the_engine_command(tmp_path: Path) -> None:
    """``engines.chunked_prefill_size`` -> the launch -> ``--chunked-prefill-size`` (both
    backends take the flag); unset, the engine's default; 0 refused naming the key."""
    from titan_core.config import ConfigError, load_config
    from titan_rl.actors.server import build_command
    from titan_rl.config import GRPOConfig
    from titan_rl.placement import plan_placement

    math = Path(__file__).resolve().parents[2] / "examples" / "math.yaml"

    def argv(*overrides: str) -> list[str]:
        cfg = load_config(GRPOConfig, math, [f"run.dir={tmp_path}", *overrides])
        launch = plan_placement(cfg, "cpu", None, None).engine
        assert launch is not None
        return build_command(launch, 31000)

    cmd = argv("engines.chunked_prefill_size=512")
    assert cmd[cmd.index("--chunked-prefill-size") + 1] == "512"
    assert "--chunked-prefill-size" not in argv()
    with pytest.raises(ConfigError, match="engines.chunked_prefill_size"):
        argv("engines.chunked_prefill_size=0")


def _sampled_seq(eng: Engine, prompt: list[int], rid: str, copy: int, **kw: Any) -> Sequence:
    """Copy ``copy`` of a seeded, sampled request (as an ``n`` > 1 request makes them)."""
    params = parse_sampling_params(
        {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}, VOCAB
    )
    return eng.make_sequence(
        prompt, params, rid=rid, seed_offset=copy, return_logprob=True, logprob_start_len=60, **kw
    )


def test_copies_of_a_prompt_are_prefilled_once_and_each_finishes_as_alone(llama: Path) -> None:
    """A group's samples share their prompt: it is forwarded once (one cache row per distinct
    prompt; the step's token budget counts it once), each copy joins the running batch with its own row, copies aborted while
    decoding drop out, and every copy left gives what it gives alone (tokens, input and
    output logprobs)."""
    a, b = _prompt(200, 50), _prompt(200, 51)
    # 5 x 200 tokens are more than a step's budget; the 2 x 200 forwarded are not
    eng = Engine(str(llama), num_threads=1, chunked_prefill_size=CHUNK * 8)
    forwarded: list[int] = []  # rows of each prefill forward
    prefill = eng.runner.prefill

    def counting(key: int, ids: torch.Tensor, *args: Any, **kw: Any) -> Any:
        forwarded.append(ids.shape[0])
        return prefill(key, ids, *args, **kw)

    eng.runner.prefill = counting  # type: ignore[method-assign]
    results: dict[str, dict[str, Any]] = {}

    def on_done(s: Sequence) -> None:
        results[s.rid] = sequence_result(s)

    seqs = [_sampled_seq(eng, a, f"a{i}", i, on_done=on_done) for i in range(3)]
    seqs += [_sampled_seq(eng, b, f"b{i}", i, on_done=on_done) for i in range(2)]
    try:
        _set_paused(eng, True)
        eng.submit(seqs)
        _step(eng)  # all five prompts, two distinct: two rows forwarded; one decode step
        assert forwarded == [2] and eng.active == seqs
        assert eng.runner.cache.layers[0].keys.shape[0] == 5
        for rid in ("b0", "b1", "a1"):  # all of b's copies and one of a's
            eng.call(lambda r=rid: eng.abort(r)).result(timeout=30)
        while len(results) < 5:
            _step(eng)
        assert forwarded == [2] and eng.runner.partial == {} and eng.num_in_flight() == 0
    finally:
        eng.shutdown()
    assert [results[r]["meta_info"]["finish_reason"]["type"] for r in ("a1", "b0", "b1")] == [
        "abort"
    ] * 3
    alone = Engine(str(llama), num_threads=1, chunked_prefill_size=-1)
    try:
        for copy in (0, 2):
            done = threading.Event()
            ref: dict[str, Any] = {}

            def finished(
                s: Sequence, box: dict[str, Any] = ref, ev: threading.Event = done
            ) -> None:
                box.update(sequence_result(s))
                ev.set()

            alone.submit([_sampled_seq(alone, a, f"ref{copy}", copy, on_done=finished)])
            assert done.wait(60)
            got = results[f"a{copy}"]
            assert got["output_ids"] == ref["output_ids"]
            assert _close(_logprobs(got), _logprobs(ref))
    finally:
        alone.shutdown()
    assert results["a0"]["output_ids"] != results["a2"]["output_ids"]  # seeds of their own


def test_copies_of_a_moe_prompt_each_get_the_routed_experts_it_gets_alone(moe: Path) -> None:
    prompt = _prompt(90, 60)
    eng = Engine(str(moe), num_threads=1)
    try:
        copies = _generate(eng, [{"prompt": prompt, "routed": True, "logprob_start_len": 30}] * 3)
        alone = _generate(eng, [{"prompt": prompt, "routed": True, "logprob_start_len": 30}])[0]
    finally:
        eng.shutdown()
    for got in copies:
        assert got["output_ids"] == alone["output_ids"]
        assert _close(_logprobs(got), _logprobs(alone))
        assert got["meta_info"]["routed_experts"] == alone["meta_info"]["routed_experts"]
