"""The README's "Extending Titan" table says how many of Titan's files each extension
touches. For an advantage estimator and a weight-sync transport the extension is made here as
a developer makes it, in a copy of Titan's packages where only the files its row names are
changed or added, then chosen from a YAML config and used, in a fresh interpreter that imports
the copy: the choices, checks and dispatch all come from the one table per axis, so the files
the row names suffice, and the files changed are counted against the row. An engine client
touches no file of Titan: it is chosen by ``engines.client`` and every place that makes an
engine client reads that key."""

from __future__ import annotations

import ast
import filecmp
import functools
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from titan_core.config import ConfigError, load_config
from titan_rl.config import GRPOConfig
from titan_rl.rollout import ClientOptions, EngineClient, engine_clients, register_engine_client

REPO = Path(__file__).resolve().parents[1]
MATH = REPO / "examples" / "math.yaml"
#: the packages an extension may touch (copied for the estimator and transport cases)
PACKAGES = ("titan_core", "titan_rl")


def _table_row(extension: str) -> str:
    """The "files it touches" cell of the Extending Titan row that starts with ``extension``
    (in the README, or the docs where the manual moved it)."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        if not doc.is_file():
            continue
        for line in doc.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[0].startswith(extension):
                return cells[2]
    raise AssertionError(f"no Extending Titan row starts with {extension!r}")


def _stated(extension: str) -> tuple[int, list[str]]:
    """(how many of Titan's files the row says the extension touches, the paths it names)."""
    cell = _table_row(extension)
    m = re.match(r"(\d+) files?(?: in Titan)?: ([^;]*)", cell)
    assert m, f"the row of {extension!r} does not start with '<n> file(s): ...': {cell!r}"
    return int(m.group(1)), re.findall(r"`([\w/.]+\.py)`", m.group(2))


def _copy(tmp: Path) -> Path:
    root = tmp / "copy"
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _touched(root: Path) -> list[str]:
    """The files of the copy that differ from the repository's, or are new."""
    out = []
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            original = REPO / rel
            if not original.is_file() or not filecmp.cmp(f, original, shallow=False):
                out.append(rel)
    return out


def _edit(path: Path, anchor: str, new: str) -> None:
    """Put ``new`` in place of ``anchor`` (found once) in ``path``."""
    text = path.read_text()
    assert text.count(anchor) == 1, f"{path}: {anchor!r} is not there once"
    path.write_text(text.replace(anchor, new))


def _run_in(root: Path, script: str) -> str:
    """``script`` in a fresh interpreter that imports Titan from the copy at ``root``."""
    prelude = textwrap.dedent(f"""
        import titan_rl
        assert titan_rl.__file__.startswith({str(root)!r}), titan_rl.__file__
        from titan_core.config import ConfigError, load_config
        from titan_rl.config import GRPOConfig
        MATH = {str(MATH)!r}
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TITAN_CONFIG", "PYTHONPATH")}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_an_advantage_estimator_is_one_file(tmp_path: Path) -> None:
    count, named = _stated("an advantage estimator")
    root = _copy(tmp_path)
    table = root / "titan_rl" / "algo" / "estimators.py"
    _edit(
        table,
        "#: every estimator algo.advantage_estimator accepts",
        "def halved_grpo(x: AdvantageInputs) -> Tensor:\n"
        "    return grpo(x) / 2\n\n\n"
        "#: every estimator algo.advantage_estimator accepts",
    )
    _edit(
        table,
        "ESTIMATORS: dict[str, Estimator] = {\n",
        'ESTIMATORS: dict[str, Estimator] = {\n    "halved_grpo": Estimator(halved_grpo, True, "x"),\n',
    )
    touched = _touched(root)
    assert touched == named and len(touched) == count, (touched, named, count)
    out = _run_in(root, """
        import torch
        from titan_rl.algo import compute_advantages
        from titan_rl.preflight import learning_warnings

        cfg = load_config(GRPOConfig, MATH, ["algo.advantage_estimator=halved_grpo"])
        rewards, mask = torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.ones(4, 3)
        grpo = cfg.algo.model_copy(update={"advantage_estimator": "grpo"})
        half = compute_advantages(rewards, 2, mask, cfg.algo)
        assert torch.equal(half, compute_advantages(rewards, 2, mask, grpo) / 2), half
        try:  # a group baseline: one sample per prompt is refused, naming the keys
            load_config(GRPOConfig, MATH, [
                "algo.advantage_estimator=halved_grpo", "rollout.n_samples_per_prompt=1",
                "train.micro_batch_size=32",
            ])
            raise AssertionError("n_samples_per_prompt=1 was accepted")
        except ConfigError as e:
            assert "algo.advantage_estimator=halved_grpo" in str(e), e
        cfg.rollout.temperature = 0.0
        assert any("rollout.temperature=0" in w for w in learning_warnings(cfg))
        print("used")
    """)  # fmt: skip
    assert out.strip() == "used"


ECHO = '''
"""``sync.transport: echo``: keeps the last buckets it was given (an extension's test)."""

from __future__ import annotations

import torch

from titan_rl.sync.transports.base import Engine, Failures, Transport, TransportSection
from titan_rl.wire.bucket import NamedTensors


class EchoSync(TransportSection):
    """``sync.echo``."""

    #: buckets kept.
    keep: int = 1

    def chosen_problem(self) -> str | None:
        return None if self.keep > 0 else "sync.transport=echo needs sync.echo.keep > 0"


class EchoTransport(Transport):
    name = "echo"
    settings_class = EchoSync
    summary = "keeps the buckets"

    def __init__(self, settings: EchoSync, device: torch.device, timeout_s: float) -> None:
        super().__init__(settings, device, timeout_s)
        self.kept: list[NamedTensors] = []

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        self.kept = [*self.kept, bucket][-self.settings.keep :]
        return {}
'''


def test_a_weight_sync_transport_is_its_module_and_the_table(tmp_path: Path) -> None:
    count, named = _stated("a weight-sync transport")
    root = _copy(tmp_path)
    package = root / "titan_rl" / "sync" / "transports"
    (package / "echo.py").write_text(ECHO.lstrip())
    _edit(
        package / "__init__.py",
        "from titan_rl.sync.transports.disk import DiskTransport\n",
        "from titan_rl.sync.transports.disk import DiskTransport\n"
        "from titan_rl.sync.transports.echo import EchoTransport\n",
    )
    _edit(package / "__init__.py", "MooncakeTransport)", "MooncakeTransport, EchoTransport)")
    touched = _touched(root)
    assert len(touched) == count, (touched, count)
    assert set(named) <= set(touched), (named, touched)
    out = _run_in(root, """
        import asyncio

        import torch

        from titan_core.config.pretrain import ModelConfig
        from titan_core.models.hf.from_titan import hf_config_for
        from titan_rl.sync import WeightSync

        cfg = load_config(GRPOConfig, MATH, ["sync.transport=echo", "sync.echo.keep=2"])
        assert cfg.sync.settings is cfg.sync.echo and cfg.sync.echo.keep == 2
        assert cfg.sync.settings.machine_problem() is None
        for wrong, says in [
            (["sync.transport=echo", "sync.echo.keep=0"], "needs sync.echo.keep > 0"),
            (["sync.echo.keep=2"], "sync.echo is set but sync.transport is 'tensor'"),
        ]:
            try:
                load_config(GRPOConfig, MATH, wrong)
                raise AssertionError(f"{wrong} was accepted")
            except ConfigError as e:
                assert says in str(e), e
        hf = hf_config_for(ModelConfig(), vocab_size=64)
        ws = WeightSync(cfg.sync, ["http://127.0.0.1:1"], hf)
        transport = ws._get_transport()
        assert type(transport).__name__ == "EchoTransport", transport
        bucket = [("w", torch.ones(2))]
        for _ in range(3):
            assert asyncio.run(transport.send([], bucket)) == {}
        assert len(transport.kept) == 2
        ws.close()
        print("used")
    """)  # fmt: skip
    assert out.strip() == "used"


class FakeClient(EngineClient):
    """An engine client of another API, in its smallest form."""

    def __init__(self, url: str, options: ClientOptions) -> None:
        self.base_url = url


def make_fake(url: str, options: ClientOptions) -> FakeClient:
    return FakeClient(url, options)


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The clients' table, restored after the test."""
    table = dict(engine_clients._FACTORIES)
    monkeypatch.setattr(engine_clients, "_FACTORIES", table)
    return table


def test_an_engine_client_touches_no_file_of_titan(clients: dict) -> None:
    """Chosen by engines.client (registered, or by path), made by every place that talks to
    the engines from the driver (recovery, colocated memory) and the trainers (weight sync)."""
    from titan_core.config.pretrain import ModelConfig
    from titan_core.models.hf.from_titan import hf_config_for
    from titan_rl.actors.recovery import EngineRecovery
    from titan_rl.colocation import colocation_for
    from titan_rl.preflight import check_engine_client
    from titan_rl.sync import WeightSync

    count, named = _stated("a rollout-engine client")
    assert (count, named) == (0, [])
    with pytest.raises(ConfigError, match=r"engines\.client 'fake' is not a registered .*sglang"):
        load_config(GRPOConfig, MATH, ["engines.client=fake"])
    by_path = load_config(GRPOConfig, MATH, [f"engines.client={__name__}:make_fake"])
    check_engine_client(by_path)
    register_engine_client("fake", make_fake)
    url = "http://127.0.0.1:1"
    for cfg in [by_path, load_config(GRPOConfig, MATH, ["engines.client=fake"])]:
        name = cfg.engines.client
        recovery = EngineRecovery([url], lambda urls, version: {}, client=name)
        memory = colocation_for(True, [url], None, True, lambda c: None, lambda: None, name)
        sync = WeightSync(cfg.sync, [url], hf_config_for(ModelConfig(), 64), client=name)
        made = [recovery._client(url), memory.memory.clients[0], sync._engines()[0].client]
        assert [type(c).__name__ for c in made] == ["FakeClient"] * 3, (name, made)


@functools.cache
def _all_calls() -> list[tuple[str, str, ast.Call]]:
    """(where, the name called, the call) of every call in Titan's and the adapters' code."""
    out = []
    for pkg in ("titan_rl", "titan_core", "adapters"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Call):
                    fn = node.func
                    called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                    out.append((f"{f.relative_to(REPO)}:{node.lineno}", called, node))
    return out


def _calls(name: str) -> list[tuple[str, ast.Call]]:
    """Every call of ``name`` (a function or a method)."""
    return [(where, node) for where, called, node in _all_calls() if called == name]


@pytest.mark.parametrize("name", ["make_engine_client", "WeightSync", "EngineRecovery"])
def test_every_place_that_makes_engine_clients_reads_engines_client(name: str) -> None:
    calls = _calls(name)
    assert calls, f"no call of {name}"
    missing = [where for where, c in calls if not any(k.arg == "client" for k in c.keywords)]
    assert not missing, f"{name} called without client= (engines.client) at {missing}"


def test_the_adapters_name_titans_transports() -> None:
    from adapters.miles.arguments import TRANSFER_MODE_TO_TRANSPORT
    from titan_rl.sync.transports import TRANSPORTS

    assert set(TRANSFER_MODE_TO_TRANSPORT.values()) <= set(TRANSPORTS)
    assert "tensor" in TRANSPORTS  # miles' --colocate
