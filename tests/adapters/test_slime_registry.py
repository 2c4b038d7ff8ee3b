"""Titan's backend through slime's own selection (``initialize_accelerator()`` /
``get_accelerator()``): in a fresh interpreter, in slime's MUSA bootstrap (its ``musa``
backend importing ``musa_patch``), and in a real Ray worker that got ``titan`` only from the
job's ``worker_process_setup_hook``; what slime calls, read from slime's installed source;
a missing peer package is an error naming it.

Each case runs in a fresh interpreter: slime's registry and Titan's start-up answers are
per-process state."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("slime.utils.accelerator", reason="slime's wheel (../shared/peers) is needed")

REPO = Path(__file__).resolve().parents[2]
BOOTSTRAP = REPO / "adapters/slime/bootstrap"
SLIME = Path(importlib.util.find_spec("slime").origin).parent  # slime's installed source

#: a vendor ``musa_patch`` as Moore Threads' look: work at import and in the hook; each
#: records whether Titan's answers were there yet
VENDOR = """
from titan_core.accelerator.megatron_compat import megatron_compat_installed
CALLS = [["import", megatron_compat_installed()]]
def patch_after_import_torch():
    CALLS.append(["hook", megatron_compat_installed()])
"""

#: a slime backend named ``musa`` whose device counts as present: slime's own MUSA backend
#: class otherwise, registered with slime's public ``register_accelerator``
TEST_MUSA = """
import sys
from slime.utils import accelerator as acc
from slime.utils.accelerator.musa import MUSAAccelerator
from titan_core.accelerator.megatron_compat import megatron_compat_installed
SEEN = {}
class TestMusa(MUSAAccelerator):
    def __init__(self):
        SEEN["musa_patch"] = getattr(sys.modules.get("musa_patch"), "__file__", None)
        SEEN["musa_titan"] = getattr(sys.modules.get("musa_titan"), "__file__", None)
        SEEN["compat"] = megatron_compat_installed()
    def is_available(self):
        return True
acc.register_accelerator("musa", TestMusa, lambda: True, priority=200, communication_backends=("mccl",))
"""

#: slime PR #2398's lookup as its description gives it: $MUSA_TITAN_PATH appended to
#: sys.path, ``import musa_titan``, ``musa_titan.apply_rl_patch()``
PR_LOOKUP = """
import importlib, os, sys
sys.path.append(os.environ["MUSA_TITAN_PATH"])
importlib.import_module("musa_titan").apply_rl_patch()
"""


def _env(**env: str) -> dict[str, str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLIME_", "MUSA_", "TITAN_", "RAY_"))
    }
    return {**clean, **env}


def _run(*code: str, **env: str) -> dict:
    """Run the code parts (each dedented) in a fresh interpreter; its last line's JSON."""
    source = "\n".join(textwrap.dedent(part) for part in code)
    proc = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True, text=True, cwd=REPO, env=_env(**env), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tree(rel: str) -> ast.Module:
    return ast.parse((SLIME / rel).read_text())


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _called(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _strings(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def slime_has_musa_titan() -> bool:
    """Whether the installed slime has PR #2398 (it names ``MUSA_TITAN_PATH``)."""
    return any(
        "MUSA_TITAN_PATH" in p.read_text() for p in (SLIME / "utils/accelerator").glob("*.py")
    )


# ---- what slime calls, from its installed source ---------------------------------------------
@pytest.mark.parametrize(
    "rel", ["backends/sglang_utils/__init__.py", "backends/megatron_utils/__init__.py"]
)
def test_slime_selects_at_import_before_sglang_and_megatron(rel):
    """These packages' first statements select the backend (module level), before anything
    of SGLang / megatron-core / DeepEP is imported: a process importing them (slime's driver,
    rollout manager, SGLang engine actors, Megatron train actors) needs ``titan`` registered."""
    body = _tree(rel).body
    at = [
        i for i, stmt in enumerate(body)
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
        and _called(stmt.value) == "initialize_accelerator"
    ]  # fmt: skip
    assert at, f"{rel}: no module-level initialize_accelerator()"
    before = body[: at[0]]
    imported = {a.name for s in before if isinstance(s, ast.Import) for a in s.names}
    imported |= {s.module or "" for s in before if isinstance(s, ast.ImportFrom)}
    assert not any(m.split(".")[0] in {"sglang", "megatron", "deep_ep"} for m in imported)
    assert not any(isinstance(s, ast.Try) for s in before)


def test_slime_imports_musa_patch_only_for_musa_and_never_calls_post_import_torch():
    """slime at this commit: ``_make_selected`` bootstraps (``_import_musa_patch``: append
    ``$MUSA_PATCH_PATH``, import ``musa_patch``) only when the name is ``musa``, before it
    checks availability and constructs the backend; ``MUSAAccelerator.post_import_torch``
    would call ``musa_patch.patch_after_import_torch()``, but nothing calls
    ``post_import_torch`` except the module-level shim, and nothing calls the shim."""
    tree = _tree("utils/accelerator/__init__.py")
    make = _function(tree, "_make_selected")
    musa_if = next(
        n for n in ast.walk(make)
        if isinstance(n, ast.If) and "musa" in _strings(n.test)
        and any(_called(c) == "_bootstrap_musa_patch_if_needed" for c in _calls(n))
    )  # fmt: skip
    factory = next(c for c in _calls(make) if _called(c) == "factory")
    available = [c for c in _calls(make) if _called(c) == "is_available"]
    assert musa_if.lineno < factory.lineno and all(musa_if.lineno < c.lineno for c in available)
    assert "musa_patch" in _strings(_function(tree, "_import_musa_patch"))
    assert "MUSA_PATCH_PATH" in _strings(_function(tree, "_append_musa_patch_path"))
    hook = _function(_tree("utils/accelerator/musa.py"), "post_import_torch")
    assert {"musa_patch", "patch_after_import_torch"} <= _strings(hook)

    callers = {}
    for path in SLIME.rglob("*.py"):
        for call in _calls(ast.parse(path.read_text())):
            if _called(call) == "post_import_torch":
                callers.setdefault(str(path.relative_to(SLIME)), []).append(call)
    assert list(callers) == ["utils/accelerator/__init__.py"]
    shim = _function(tree, "post_import_torch")  # `def post_import_torch(): _backend().post_...`
    assert all(
        shim.lineno <= c.lineno <= shim.end_lineno for c in callers["utils/accelerator/__init__.py"]
    )


# ---- titan through slime's selection -------------------------------------------------------
def test_without_registration_slime_refuses_titan():
    """The crash this fixes: slime's own module import under SLIME_ACCELERATOR=titan in a
    process where nothing registered it."""
    proc = subprocess.run(
        [sys.executable, "-c", "import slime.backends.sglang_utils"],
        capture_output=True, text=True, cwd=REPO, env=_env(SLIME_ACCELERATOR="titan"), timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and "Unknown accelerator 'titan'" in proc.stderr


def test_registry_selects_titan_and_its_shims_answer_on_cpu():
    """After the worker hook (``setup_worker``, which asks no device), slime's import-time
    selection picks ``titan``, and only then installs Titan's start-up answers and learns
    its communication backend; slime's shims answer."""
    out = _run(
        """
        import json, torch
        from adapters.slime.accelerator import setup_worker
        from titan_core.accelerator import registry
        from titan_core.accelerator.megatron_compat import megatron_compat_installed
        setup_worker()
        from slime.utils import accelerator as acc
        # no device asked yet (Titan chose none), no start-up answers, no backend known
        before = [registry._CURRENT is None, megatron_compat_installed(), acc.is_accelerator_backend("gloo")]
        import slime.backends.sglang_utils                   # slime selects at import
        a = acc.initialize_accelerator()
        acc.set_device(0)
        acc.synchronize()
        s, e = acc.new_stream(), acc.new_event()
        with acc.stream(s):
            x = torch.ones(3, device=acc.device()) * 2
        e.record()
        acc.manual_seed(7)
        acc.set_rng_state(acc.get_rng_state())
        free, total = acc.mem_get_info()
        print(json.dumps({
            "before": before, "compat": megatron_compat_installed(),
            "name": a.name, "same": a is acc.get_accelerator(), "type": acc.device_type(),
            "device": str(acc.device()), "pg": acc.process_group_backend(),
            "pg_gloo": acc.process_group_backend("gloo"), "wu": acc.weight_update_backend(),
            "count": acc.device_count(), "x": x.sum().item(), "mem": [free > 0, total >= free],
            "alloc": acc.memory_allocated() >= 0, "is_accel_gloo": acc.is_accelerator_backend("gloo"),
        }))
        """,
        SLIME_ACCELERATOR="titan",
    )
    assert out["before"] == [True, None, False] and out["compat"] == "cpu"
    assert (
        out["name"] == "titan" and out["same"] and out["type"] == "cpu" and out["device"] == "cpu"
    )
    assert out["pg"] == "gloo" and out["pg_gloo"] == "gloo" and out["wu"] == "gloo"
    assert out["count"] == 1 and out["x"] == 6.0 and out["mem"] == [True, True] and out["alloc"]
    assert out["is_accel_gloo"]


def test_without_the_variable_titan_is_picked_where_slime_has_no_backend():
    out = _run(
        """
        import json
        import adapters.slime as titan_slime
        from slime.utils import accelerator as acc
        before = acc.initialize_accelerator()   # slime alone: no CPU backend
        titan_slime.register()
        acc.reset_accelerator()
        print(json.dumps({"before": before is None, "after": acc.get_accelerator().name}))
        """
    )
    assert out == {"before": True, "after": "titan"}


@pytest.mark.slow
def test_ray_workers_get_titan_from_the_setup_hook(tmp_path):
    """slime's driver run through ``python -m adapters.slime.launch`` (Ray started as the
    script's first Ray call would, with the job's runtime env): the driver's import-time
    selection finds ``titan``, and a Ray actor whose module selects at import (as slime's
    rollout manager's does) gets ``titan`` from the job's ``worker_process_setup_hook``
    alone, before Ray loads the actor's class (the actor's own ``env_vars``, as slime gives
    its actors, merge with the job's); Titan's answers are installed there. ~45 s here: a
    Ray start with slime's defaults, a worker importing megatron-core."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(
        """
        import json, os, sys
        import ray
        from tests.adapters.slime_probe import Probe   # selects in the driver, at import
        from slime.utils import accelerator
        # an actor with its own env_vars, as slime creates its rollout manager and engines
        own = {"env_vars": {"RAY_USE_UVLOOP": "0"}}
        probe = ray.remote(num_cpus=0)(Probe).options(runtime_env=own).remote()
        out = ray.get(probe.report.remote())
        env = ray.get_runtime_context().runtime_env
        out.update(driver=accelerator.get_accelerator().name, driver_pid=os.getpid(),
                   argv=sys.argv[1:], hook=env.get("worker_process_setup_hook"))
        ray.shutdown()
        print(json.dumps(out))
        """
    ))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "adapters.slime.launch", str(script), "--num-rollout", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env=_env(RAY_ADDRESS="local", OMP_NUM_THREADS="1"),  # a Ray of its own
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["driver"] == "titan" and out["argv"] == ["--num-rollout", "1"]
    assert out["hook"] == "adapters.slime.accelerator.setup_worker"
    assert out["pid"] != out["driver_pid"]
    assert out["at_import"] == "titan" and out["compat_at_import"] == "cpu"
    assert out["name"] == "titan" and out["device"] == "cpu" and out["pg"] == "gloo"
    assert out["gloo_is_device_backend"]


# ---- slime's musa backend and Titan's bootstrap modules ---------------------------------------
def test_slime_musa_selection_runs_titans_musa_patch_after_the_vendors(tmp_path):
    """SLIME_ACCELERATOR=musa, MUSA_PATCH_PATH=Titan's folder, the vendor's ``musa_patch`` in
    TITAN_VENDOR_MUSA_PATCH_PATH. slime's built-in ``musa`` on this CPU machine: its selection
    imports Titan's module, then refuses (no torch.musa). A ``musa`` backend whose device
    counts as present (slime's MUSA class, registered with ``register_accelerator``): slime
    constructs it after the bootstrap; the vendor's module and hook ran once, before Titan's
    answers; slime's ``post_import_torch`` hook changes nothing more."""
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    (vendor / "musa_patch.py").write_text(VENDOR)
    out = _run(
        """
        import json, sys
        from slime.utils import accelerator as acc
        try:
            acc.initialize_accelerator()
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        bootstrap = getattr(sys.modules.get("musa_patch"), "__file__", None)
        """,
        TEST_MUSA,
        """
        a = acc.initialize_accelerator()
        acc.post_import_torch()  # MUSAAccelerator's: musa_patch.patch_after_import_torch()
        acc.post_import_torch()
        import musa_patch
        print(json.dumps({
            "refused": refused, "bootstrap": bootstrap, "name": a.name, "seen": SEEN,
            "vendor_calls": musa_patch.CALLS,
            "vendor": sys.modules["titan_vendor_musa_patch"].__file__,
            "titan_registered": acc.is_accelerator_backend("gloo"),
        }))
        """,
        SLIME_ACCELERATOR="musa",
        MUSA_PATCH_PATH=str(BOOTSTRAP),
        TITAN_VENDOR_MUSA_PATCH_PATH=str(vendor),
        TITAN_ACCELERATOR="cpu",  # Titan's device here (MUSA_PATCH_PATH alone means musa)
    )
    assert "Requested accelerator 'musa' is unavailable" in out["refused"]
    assert Path(out["bootstrap"]) == BOOTSTRAP / "musa_patch.py"
    assert out["name"] == "musa" and out["titan_registered"]
    assert (
        out["seen"]["compat"] == "cpu"
        and Path(out["seen"]["musa_patch"]) == BOOTSTRAP / "musa_patch.py"
    )
    assert out["vendor_calls"] == [["import", None], ["hook", None]]
    assert Path(out["vendor"]) == vendor / "musa_patch.py"


def test_musa_titan_path_bootstrap(tmp_path):
    """slime PR #2398 (open): ``musa_titan`` through ``MUSA_TITAN_PATH``, ``apply_rl_patch()``
    during MUSA initialization. With a slime that has it, through slime's selection; with
    the installed slime (before it), its lookup as the PR describes it. ``MUSA_PATCH_PATH``
    names the vendor's folder: its ``musa_patch`` runs first, under its own name."""
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    (vendor / "musa_patch.py").write_text(VENDOR)
    select = [TEST_MUSA, "acc.initialize_accelerator()"] if slime_has_musa_titan() else [PR_LOOKUP]
    out = _run(
        *select,
        """
        import json, sys
        import musa_titan
        from titan_core.accelerator.megatron_compat import megatron_compat_installed
        again = musa_titan.apply_rl_patch()
        musa_titan.patch_after_import_torch()
        print(json.dumps({
            "module": musa_titan.__file__, "again": again, "compat": megatron_compat_installed(),
            "vendor": sys.modules["musa_patch"].__file__,
            "vendor_calls": sys.modules["musa_patch"].CALLS,
        }))
        """,
        SLIME_ACCELERATOR="musa",
        MUSA_TITAN_PATH=str(BOOTSTRAP),
        MUSA_PATCH_PATH=str(vendor),
        TITAN_ACCELERATOR="cpu",
    )
    assert Path(out["module"]) == BOOTSTRAP / "musa_titan.py"
    assert out["again"] == "cpu" and out["compat"] == "cpu"
    assert Path(out["vendor"]) == vendor / "musa_patch.py"
    assert out["vendor_calls"] == [["import", None], ["hook", None]]


# ---- the runtime env a driver gives Ray ------------------------------------------------------
def test_runtime_env_names_the_hook_and_fills_only_what_a_submitted_job_lacks(monkeypatch):
    from adapters.slime import runtime_env as renv

    monkeypatch.delenv(renv.JOB_CONFIG_ENV, raising=False)
    monkeypatch.setenv("SLIME_ACCELERATOR", "titan")
    monkeypatch.setenv("PYTHONPATH", "/x")
    env = renv.runtime_env()
    assert env["worker_process_setup_hook"] == "adapters.slime.accelerator.setup_worker"
    assert env["env_vars"]["PYTHONPATH"] == os.pathsep.join([str(REPO), "/x"])
    assert env["env_vars"]["SLIME_ACCELERATOR"] == "titan"

    job = {"worker_process_setup_hook": renv.SETUP_HOOK, "env_vars": {"PYTHONPATH": "/y"}}
    monkeypatch.setenv(renv.JOB_CONFIG_ENV, json.dumps({"runtime_env": job, "metadata": {}}))
    assert renv.runtime_env() == {"env_vars": {"SLIME_ACCELERATOR": "titan"}}
    other = {"worker_process_setup_hook": "my.hook"}
    with pytest.raises(RuntimeError, match="my.hook"):
        renv.runtime_env(other)


def test_ray_init_gives_workers_the_hook(monkeypatch):
    """``python -m adapters.slime.train``'s Ray start (``ray_init``) carries the hook."""
    import ray

    from adapters.common import driver
    from adapters.slime.runtime_env import SETUP_HOOK

    seen: dict = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    # set, then removed: monkeypatch restores each on exit, whatever ray_init writes there
    # (a TITAN_CONFIG left behind would reach every later test's driver subprocess)
    for var in ("SLIME_ACCELERATOR", "TITAN_CONFIG", "RAY_raylet_start_wait_time_s"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)

    class Args:
        titan_config = str(REPO / "examples/math.yaml")
        actor_num_nodes, actor_num_gpus_per_node, rollout_num_gpus, colocate = 1, 1, 1, True

    driver.ray_init(Args())
    assert seen["runtime_env"]["worker_process_setup_hook"] == SETUP_HOOK
    assert seen["runtime_env"]["env_vars"]["SLIME_ACCELERATOR"] == "titan"
    assert seen["runtime_env"]["env_vars"]["TITAN_CONFIG"] == Args.titan_config


def test_titan_switches_reach_slime_args_from_one_file(tmp_path):
    from adapters.slime.patch import apply_switches, megatron_switches

    cfg = tmp_path / "titan.yaml"
    cfg.write_text(
        "model: {num_moe_experts: 4, moe_token_dispatcher_type: flex}\n"
        "parallel: {overlap_moe_expert_parallel_comm: true}\n"
        "train: {fp8: e4m3, fp8_recipe: blockwise, offload_modules: [core_attn]}\n"
    )
    sw = megatron_switches(str(cfg))
    assert sw["fp8"] == "e4m3" and sw["fp8_recipe"] == "blockwise"
    assert (
        sw["moe_token_dispatcher_type"] == "flex" and sw["moe_flex_dispatcher_backend"] == "deepep"
    )
    assert sw["overlap_moe_expert_parallel_comm"] is True
    assert sw["fine_grained_activation_offloading"] is True and sw["offload_modules"] == [
        "core_attn"
    ]

    class Args:  # slime's args is a plain namespace
        pass

    args = Args()
    assert apply_switches(args, str(cfg)) == sw
    assert args.fp8 == "e4m3" and args.offload_modules == ["core_attn"]
    assert megatron_switches(None) == {} or "TITAN_CONFIG" in os.environ


def test_missing_peer_package_is_an_error_naming_it():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['slime'] = None\n"
         "import adapters.slime.accelerator"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "PeerImportError" in last and "slime package is not installed" in last
    assert "shared/peers/slime" in last


def test_peer_with_a_missing_dependency_names_the_dependency():
    from adapters.peers import PeerImportError, import_peer

    with pytest.raises(PeerImportError, match="has no module 'slime.not_a_module'"):
        import_peer("slime.not_a_module")
