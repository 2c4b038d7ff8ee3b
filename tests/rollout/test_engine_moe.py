"""Qwen3-MoE in the built-in engine: transformers >= 5 keeps the experts of a layer in fused
3-D parameters (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``); weight updates name
them per expert, as HF checkpoints and SGLang do (``mlp.experts.{e}.gate_proj.weight``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_rl.engine.core import Engine
from titan_rl.engine.sampling import RequestError

PROBE = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory, make_model) -> tuple[Path, Path]:
    a = make_model(tmp_path_factory.mktemp("moe-a"), "qwen3_moe", seed=0)
    b = make_model(tmp_path_factory.mktemp("moe-b"), "qwen3_moe", seed=1)
    return a, b


@pytest.fixture(scope="module")
def engine(moe_dirs: tuple[Path, Path]):
    eng = Engine(str(moe_dirs[0]), num_threads=1, load_tokenizer=False)
    yield eng
    eng.shutdown()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROBE).logits


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def test_fused_experts_are_named_per_expert(engine: Engine, moe_dirs: tuple[Path, Path]) -> None:
    state = engine.model.state_dict()
    if not any(n.endswith("mlp.experts.gate_up_proj") for n in state):
        pytest.skip("this transformers keeps per-expert parameters (nothing to map)")
    ckpt = load_file(str(moe_dirs[0] / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in ckpt
    assert engine.runner.param_names() == set(ckpt)
    assert engine.runner.missing_params(set(ckpt)) == set()
    # fused names cover their experts too
    assert engine.runner.missing_params(set(state)) == set()
    # views into the fused tensors: the checkpoint's values, in place
    for name, t in ckpt.items():
        assert torch.equal(engine.runner.tensor(name), t), name


def test_per_expert_update_serves_the_new_model(
    engine: Engine, moe_dirs: tuple[Path, Path]
) -> None:
    new = load_file(str(moe_dirs[1] / "model.safetensors"))
    ref = hf_model(moe_dirs[1])
    assert (logits(engine.model) - logits(ref)).abs().max() > 0.1
    n = engine.call(lambda: engine.runner.load(sorted(new.items()))).result()
    assert n == len(new)
    assert (logits(engine.model) - logits(ref)).abs().max() < 1e-5
    # and back, with the fused names (both namings are accepted)
    old = hf_model(moe_dirs[0])
    engine.call(lambda: engine.runner.load(list(old.state_dict().items()))).result()
    assert torch.equal(logits(engine.model), logits(old))


def test_bad_expert_names_and_shapes_are_rejected(engine: Engine) -> None:
    before = engine.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].clone()
    good = ("model.layers.0.mlp.experts.1.gate_proj.weight", torch.zeros(32, 64))
    with pytest.raises(RequestError, match="unknown parameter"):
        engine.runner.load(
            [good, ("model.layers.0.mlp.experts.4.gate_proj.weight", torch.zeros(32, 64))]
        )
    with pytest.raises(RequestError, match="shape"):
        engine.runner.load(
            [good, ("model.layers.0.mlp.experts.0.down_proj.weight", torch.zeros(32, 64))]
        )
    # nothing applied when one name or shape is wrong
    assert torch.equal(engine.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"], before)


def test_disk_checkpoint_with_fused_names_is_complete(
    engine: Engine, moe_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    fused = {k: v.clone() for k, v in hf_model(moe_dirs[1]).state_dict().items()}
    save_file(fused, str(tmp_path / "model.safetensors"))
    assert (
        engine.runner.missing_params(set(load_file(str(tmp_path / "model.safetensors")))) == set()
    )


def test_released_weights_free_their_storage_and_take_an_update(
    engine: Engine, moe_dirs: tuple[Path, Path]
) -> None:
    """Release frees every parameter (fused experts included), names and shapes stay; the
    resumed weights hold no values until an update loads them (per-expert names)."""
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    shape = engine.runner.tensor(name).shape
    assert engine.runner.weight_bytes() > 0
    engine.call(lambda: engine.memory.release(["weights"])).result()
    try:
        assert engine.runner.weight_bytes() == 0 and engine.memory.released
        assert engine.runner.tensor(name).is_meta and engine.runner.tensor(name).shape == shape
        with pytest.raises(RequestError, match="weights are released"):
            engine.runner.load([(name, torch.zeros(shape))])
    finally:
        engine.call(lambda: engine.memory.resume(["weights"])).result()
    assert not engine.memory.released and engine.runner.weight_bytes() > 0
    assert torch.isnan(engine.runner.tensor(name)).all()
    ckpt = load_file(str(moe_dirs[0] / "model.safetensors"))
    engine.call(lambda: engine.runner.load(sorted(ckpt.items()))).result()
    assert torch.equal(logits(engine.model), logits(hf_model(moe_dirs[0])))
