"""The driver's rollout side: the task's prompts, the tokenizer, the reward, and the
rollouts and evals it sends to the engines (through the router's client)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_core.data.tokenizer import build_tokenizer
from titan_rl.config import GRPOConfig
from titan_rl.data import PromptSampler, PromptSet, load_splits, stop_token_ids
from titan_rl.rollout.coalesce import KEY as COALESCE_KEY
from titan_rl.rollout.coalesce import coalesce_problem, engine_problem
from titan_rl.rollout.generate import RolloutResult, VersionCheck, generate_groups
from titan_rl.rollout.generate import evaluate as evaluate_prompts
from titan_rl.rollout.partial import PartialBuffer
from titan_rl.rollout.rewarding import SampleRewarder

if TYPE_CHECKING:
    from titan_rl.actors.recovery import EngineRecovery
    from titan_rl.rollout.engine_api import EngineClient


def _skipped_note(ps: PromptSet, key: str, cfg: GRPOConfig) -> None:
    if ps.skipped:
        print(
            f"data: skipped {ps.skipped} rows of {key} {ps.source} without both "
            f"{cfg.data.prompt_key!r} and {cfg.data.label_key!r}",
            flush=True,
        )


class Rollouts:
    """Prompts drawn by a resumable sampler, answered by the engines and scored.

    A dataset that cannot be used raises DatasetError here, before anything starts.
    """

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tok = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model)
        train, held_out = load_splits(cfg.data, cfg.run.seed)
        self.eval_prompts = held_out.prompts
        #: written with the first record of the run
        self.data_stats = {"data/skipped_rows": train.skipped}
        _skipped_note(train, "data.path", cfg)
        if cfg.data.eval_path:
            self.data_stats["data/eval_skipped_rows"] = held_out.skipped
            _skipped_note(held_out, "data.eval_path", cfg)
        self.sampler = PromptSampler(train.prompts, cfg.run.seed)
        #: groups a rollout left running, continued by the next one (rollout.partial)
        self.carried = PartialBuffer()
        #: where a response ends: end of text and the task's own stop texts
        self.stop_ids = stop_token_ids(self.tok, train.stop, f"data.type={cfg.data.type}")
        #: scores samples in place off the event loop, each call under reward.timeout_s
        self.reward = SampleRewarder(cfg.reward)
        #: why the rollout sends one request per group, once said (rollout.coalesce=auto)
        self._coalesce_said = False

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([i for i in ids if i not in self.stop_ids])

    def versions(self, recovery: EngineRecovery | None) -> VersionCheck | None:
        """The weight versions a rollout accepts now (see titan_rl/actors/recovery.py)."""
        if recovery is None:
            return None
        return VersionCheck(
            recovery.accepted, self.cfg.rollout.on_stale_version, recovery.ensure_serving
        )

    async def coalesce(self, client: EngineClient) -> bool:
        """Whether the rollout sends its group requests as one batched request
        (rollout.coalesce, see titan_rl/rollout/coalesce.py); the first time it does not
        under ``auto``, a line says why."""
        problem = coalesce_problem(self.cfg.rollout, self.cfg.engines)
        if problem is None:
            problem = await engine_problem(client)
        if problem is not None and self.cfg.rollout.coalesce != "off" and not self._coalesce_said:
            self._coalesce_said = True
            print(
                f"rollout: one /generate request per group ({COALESCE_KEY}=auto: {problem})",
                flush=True,
            )
        return problem is None

    @staticmethod
    async def _watched(work: Any, recovery: EngineRecovery | None) -> Any:
        return await (work if recovery is None else recovery.guard(work))

    async def rollout(
        self, client: EngineClient, step: int, recovery: EngineRecovery | None
    ) -> RolloutResult:
        """``rollout.prompts_per_step`` groups that passed the dynamic filter (with
        rollout.partial, the groups the last rollout left go first, and new prompts fill up
        to ``prompts_per_step x over_sample_factor`` in flight). ``recovery``: the engines'
        (it gives restarted engines the current weights; None: no engine is restarted)."""
        r = self.cfg.rollout
        carried = self.carried.take()
        n_prompts = max(0, int(r.prompts_per_step * r.over_sample_factor) - len(carried))
        prompts = self.sampler.take(n_prompts)
        coalesce = await self.coalesce(client)
        result = await self._watched(generate_groups(
            client, prompts, self.encode, self.decode, r, self.stop_ids, self.reward,
            want_groups=r.prompts_per_step, seed=self.cfg.run.seed * 100_003 + step,
            versions=self.versions(recovery), num_layers=self.cfg.model.num_layers,
            carried=carried, coalesce=coalesce,
        ), recovery)  # fmt: skip
        self.carried.put(result.carry)
        self.reward.check_timeouts(f"step {step}")  # most timed out: warned, or stopped
        if len(result.samples) < r.prompts_per_step * r.n_samples_per_prompt:
            raise RuntimeError(
                f"step {step}: only {len(result.samples) // r.n_samples_per_prompt} groups passed "
                "the dynamic filter; raise rollout.over_sample_factor"
            )
        return result

    async def evaluate(self, client: EngineClient, recovery: EngineRecovery | None) -> float:
        """Greedy accuracy on the held-out prompts (through ``rollout.generate_fn`` when set);
        their requests are coalesced as a rollout's are, in batches of at most
        ``rollout.max_concurrency`` prompts (one request per prompt, 500 of them, took the
        default example's evaluation 8 s, mostly in the HTTP client's connection pool)."""
        r = self.cfg.rollout
        coalesce = await self.coalesce(client)
        acc = await self._watched(evaluate_prompts(
            client, self.eval_prompts, self.encode, self.decode,
            r.max_response_len, self.stop_ids, self.reward,
            self.versions(recovery), cfg=r, coalesce=coalesce, wave=r.max_concurrency,
        ), recovery)  # fmt: skip
        self.reward.check_timeouts("evaluation")
        return acc
