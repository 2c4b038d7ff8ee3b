"""The built-in engine's model owner: continuous batching over an HF causal LM on CPU.

One thread owns the model. Between decode steps it runs queued commands (weight updates,
aborts, pauses) and admits new requests: each group of equal-length prompts is prefilled
together (no padding), and its KV cache is merged into the running batch, which is kept
left-padded with a 2D attention mask and explicit per-row position ids. Every decode step
runs all active requests in one forward. Rows leave as they finish; columns that are padding
for every remaining row are trimmed.

Prefill is chunked (SGLang's ``--chunked-prefill-size``): each scheduler iteration prefills at
most that many prompt tokens, then runs the decode step of the running batch. A prompt longer
than what is left of an iteration's budget is prefilled a chunk at a time into its own partial
KV cache (positions continue from the cache, so the chunks compute what one forward of the
whole prompt does); prompts admitted since go before the one whose chunk ended the last
iteration. So a short request waits for the chunk in flight and its round-robin turn, not for
another client's whole prompt, and a long prompt still gets a chunk at least every other
iteration. The model and its cache live behind a :class:`~titan_rl.engine.runner.Runner`:
this process's :class:`~titan_rl.engine.runner.ModelRunner`, or with ``tp_size`` N > 1 the TP
leader, which runs every operation on the N-1 workers too (:mod:`titan_rl.engine.tp`); the
engine does not ask which. The weights by name are the runner's (``engine.runner``), the
memory released for a colocated trainer :class:`~titan_rl.engine.memory.Memory`'s.

Waiting requests are admitted fairly (deficit round-robin, :data:`FAIR_QUANTUM` sequences a
turn), so a short request waits for a turn per queued request, not behind all their sequences;
the queue holds at most ``max_queued_requests`` sequences (then :class:`QueueFullError`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from titan_core.models.hf.families import FAMILIES
from titan_rl.engine.memory import Memory
from titan_rl.engine.routing import encode_routed_experts
from titan_rl.engine.runner import Runner
from titan_rl.engine.sampling import GREEDY_EPS, BatchSampler, RequestError, SamplingParams
from titan_rl.engine.tp.comm import threads_per_rank
from titan_rl.engine.tp.leader import start_runner
from titan_rl.engine.tp.shard import check_tp
from titan_rl.engine_settings import DEFAULT_CHUNKED_PREFILL_SIZE, EngineSettings

log = logging.getLogger("titan_rl.engine")

#: sequences a waiting request may have admitted per round-robin turn: a prompt's n copies
#: (GRPO groups of up to 16) usually start together, and no request waits for more than
#: this many sequences of each request queued before it
FAIR_QUANTUM = 16


class QueueFullError(Exception):
    """The pending queue is full (``max_queued_requests``); the caller may retry later."""


@dataclass
class _Waiting:
    """A submitted request's sequences not yet admitted, and what is left of its turn."""

    seqs: deque[Sequence]
    credit: int = 0


@dataclass(eq=False)
class _Prefill:
    """Equal-length prompts prefilled together, a chunk at a time, into one partial cache
    (the runner's ``partial[key]``) until the last chunk gives their first tokens."""

    key: int
    seqs: list[Sequence]
    #: prompt tokens already in the partial cache
    done: int = 0
    #: the partial cache's rows (0 before the first chunk), and the row of each of ``seqs``:
    #: an aborted sequence's row is dropped at the next chunk
    cached: int = 0
    rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rows = list(range(len(self.seqs)))

    @property
    def length(self) -> int:
        return len(self.seqs[0].prompt)

    def left(self) -> int:
        """Prompt tokens still to prefill, over its distinct prompts (each is forwarded once)."""
        return _distinct(self.seqs) * (self.length - self.done)


@dataclass
class Sequence:
    """One sampled completion (a request with ``n`` > 1 is ``n`` sequences)."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    #: SGLang's R3 fields: report the experts of tokens [routed_experts_start_len, seqlen - 1)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    on_done: Callable[[Sequence], None] | None = None
    #: streaming: called on the engine thread after each token of an unfinished sequence
    on_token: Callable[[Sequence], None] | None = None
    #: ``sampling_seed`` (+ the copy's index for n > 1): see :func:`sampling.sample`
    seed: int | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[list[Any]]] = field(default_factory=list)
    input_logprobs: list[list[Any]] | None = None
    #: routed experts of the tokens fed so far, one [tokens, layers, top_k] block per forward
    routed: list[torch.Tensor] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    created: float = field(default_factory=time.perf_counter)
    finished_at: float = 0.0
    weight_version: str = ""
    text: str | None = None
    #: the token ids that end it (its stop_token_ids, and EOS unless ignore_eos), once known
    stop_ids: frozenset[int] | None = None
    #: the prompt's hash: copies of one prompt are prefilled once (Engine._prefill_chunk), so
    #: the scheduler budgets a prefill by its distinct prompts
    prompt_key: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_key = hash(tuple(self.prompt))


def _distinct(seqs: Iterable[Sequence]) -> int:
    """Distinct prompts among ``seqs`` (by hash: for budgets; what is forwarded is exact)."""
    return len({s.prompt_key for s in seqs})


def _rid_matches(seq_rid: str, rid: str | None) -> bool:
    """``rid`` itself, or one of its ``n`` > 1 copies (``{rid}_{i}``)."""
    if not rid:
        return False
    if seq_rid == rid:
        return True
    prefix = rid + "_"
    return seq_rid.startswith(prefix) and seq_rid[len(prefix) :].isdigit()


class Engine:
    """Loads the model and serves generation and weight updates from one thread."""

    def __init__(
        self,
        model_path: str,
        settings: EngineSettings | None = None,
        *,
        load_tokenizer: bool = True,
        **overrides: Any,
    ) -> None:
        """``settings`` (default: every one's default) with ``overrides``, settings by name
        (``Engine(path, num_threads=1)``); ValueError for a model or a setting it cannot run."""
        from transformers import AutoConfig

        s = dataclasses.replace(settings or EngineSettings(), **overrides)
        self.settings = s
        path = Path(model_path)
        if not path.is_dir():
            raise ValueError(
                f"--model-path {model_path!r} is not a local directory; the CPU engine never downloads"
            )
        # the engine's threads (default: torch's) are shared by its TP ranks
        torch.set_num_threads(threads_per_rank(s.num_threads, s.tp_size))
        config = AutoConfig.from_pretrained(str(path))
        # the families the trainer maps to HF names: what a weight sync can send
        if config.model_type not in FAMILIES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported by the CPU engine; "
                f"supported: {sorted(FAMILIES)}"
            )
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) or any(
            t != "full_attention" for t in layer_types
        ):
            raise ValueError("sliding-window attention layers are not supported by the CPU engine")
        check_tp(config, s.tp_size)
        self.tp_size = s.tp_size
        #: the model: this process's, or rank 0's over the TP workers (started first)
        self.runner: Runner = start_runner(
            str(path), s.dtype, s.tp_size, torch.get_num_threads(), s.model_impl
        )
        self.model = self.runner.model
        self.config = self.model.config
        #: the experts each token is routed to, recorded for requests that ask for them
        self.routing = self.runner.routing
        self.model_path = str(path)
        self.vocab_size = int(self.config.vocab_size)
        limit = int(getattr(self.config, "max_position_embeddings", 0) or 0)
        self.context_length = int(s.context_length or limit or 4096)
        self.max_running = s.max_running_requests
        self.max_prefill_tokens = s.max_prefill_tokens
        chunk = s.chunked_prefill_size
        if chunk is None:
            chunk = DEFAULT_CHUNKED_PREFILL_SIZE
        #: prompt tokens prefilled per scheduler iteration; None (given as -1): no limit
        self.chunked_prefill_size = chunk if chunk > 0 else None
        #: bound of the pending queue in sequences (as SGLang counts a batch's or n's items)
        self.max_queued = s.max_queued_requests
        self.weight_version = s.weight_version
        self.eos_ids = self._eos_ids()
        self.tokenizer = self._load_tokenizer(path) if load_tokenizer else None
        self._sampler = BatchSampler(torch.Generator().manual_seed(s.random_seed))

        self._pending: deque[_Waiting] = deque()  # round-robin order
        self._num_pending = 0
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = False
        self.paused = False
        #: memory released with /release_memory_occupation (SGLang's tags), and the counts
        self.memory = Memory(self.runner, self.num_running, self._reset_batch)
        # batch state (engine thread only); its KV cache is the runner's, row for row
        self.active: list[Sequence] = []
        #: prompts admitted and not yet wholly prefilled, in the order they get chunks; the
        #: one whose chunk ended the last iteration's budget waits in ``_carry`` until the
        #: prompts admitted since have joined the queue ahead of it
        self._prefilling: deque[_Prefill] = deque()
        self._carry: _Prefill | None = None
        self._unit_keys = itertools.count()
        self._rids: set[str] = set()
        self.steps = 0
        #: prefill forwards (a whole prompt group or one chunk of it)
        self.prefill_chunks = 0
        self.generated_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="titan-engine", daemon=True)
        self._thread.start()

    # ---- setup helpers ---------------------------------------------------------------
    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list | tuple):
                ids.update(int(x) for x in src)
        return ids

    @staticmethod
    def _load_tokenizer(path: Path) -> Any:
        if not any(
            (path / f).exists()
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            return None
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # a broken tokenizer should not stop an input_ids-only server
            log.warning("could not load the tokenizer from %s: %s", path, e)
            return None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.runner.alive

    # ---- API used by the HTTP server (any thread) --------------------------------------
    def make_sequence(
        self,
        prompt: list[int],
        params: SamplingParams,
        rid: str | None = None,
        seed_offset: int = 0,
        **kw: Any,
    ) -> Sequence:
        """Validate a prompt against the context and build a Sequence (raises RequestError)."""
        if len(prompt) == 0:
            raise RequestError("input_ids is empty; send at least one token")
        if len(prompt) >= self.context_length:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens but the context length is {self.context_length}; "
                "shorten the prompt"
            )
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"input_ids contains token {bad[0]} outside the vocabulary (size {self.vocab_size})"
            )
        max_new = min(params.max_new_tokens, self.context_length - len(prompt))
        seed = None
        if params.sampling_seed is not None:
            seed = (params.sampling_seed + seed_offset) % (2**63)
        return Sequence(
            rid=rid or uuid.uuid4().hex,
            prompt=list(prompt),
            params=params,
            max_new=max_new,
            seed=seed,
            **kw,
        )

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue one request's sequences; each one's ``on_done`` is called on the engine
        thread when it ends. Raises :class:`QueueFullError` when the queue has no room."""
        if not seqs:
            return
        limit = self.max_queued
        if limit is not None and len(seqs) > limit:
            raise RequestError(
                f"the request holds {len(seqs)} sequences but the engine queues at most {limit} "
                "(--max-queued-requests); split it into smaller requests"
            )
        with self._lock:
            for s in seqs:
                if s.rid in self._rids:
                    raise RequestError(
                        f"request id {s.rid!r} is already running; rids must be unique"
                    )
            if limit is not None and self._num_pending + len(seqs) > limit:
                raise QueueFullError(
                    f"the engine's queue holds {self._num_pending} waiting sequences and takes "
                    f"at most {limit} (--max-queued-requests); retry later"
                )
            for s in seqs:
                self._rids.add(s.rid)
            self._pending.append(_Waiting(deque(seqs)))
            self._num_pending += len(seqs)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between steps (weight updates, aborts, pauses)."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    def num_running(self) -> int:
        """Sequences admitted to the batch (SGLang's ``num_running_reqs``: the waiting ones
        are ``num_queued_reqs``, counted apart)."""
        with self._lock:
            return len(self._rids) - self._num_pending

    def num_in_flight(self) -> int:
        """Sequences submitted and not finished: running and waiting."""
        with self._lock:
            return len(self._rids)

    def num_queued(self) -> int:
        """Sequences waiting to be admitted."""
        with self._lock:
            return self._num_pending

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.runner.close()

    # ---- commands (engine thread) -------------------------------------------------------
    def abort(
        self, rid: str | None, abort_all: bool = False, message: str = "aborted by request"
    ) -> int:
        """Finish matching running or queued sequences with an ``abort`` finish reason."""

        def aborted(s: Sequence) -> bool:
            if not (abort_all or _rid_matches(s.rid, rid)):
                return False
            s.finish_reason = {"type": "abort", "message": message}
            self._finish(s)
            return True

        n = 0
        with self._lock:
            for waiting in self._pending:
                kept = deque(s for s in waiting.seqs if not aborted(s))
                n += len(waiting.seqs) - len(kept)
                waiting.seqs = kept
            self._pending = deque(w for w in self._pending if w.seqs)
            self._num_pending = sum(len(w.seqs) for w in self._pending)
        for unit in self._units():
            kept = [(s, r) for s, r in zip(unit.seqs, unit.rows, strict=True) if not aborted(s)]
            n += len(unit.seqs) - len(kept)
            if not kept:
                self._drop_unit(unit)
            elif len(kept) != len(unit.seqs):
                unit.seqs, unit.rows = [s for s, _ in kept], [r for _, r in kept]
        keep = [i for i, s in enumerate(self.active) if not aborted(s)]
        n += len(self.active) - len(keep)
        if len(keep) != len(self.active):
            self._select_rows(keep)
        return n

    # ---- the loop -------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            self._run_commands()
            with self._lock:
                has_pending = bool(self._pending)
            idle = not (has_pending or self.active or self._prefilling or self._carry)
            if self.paused or self.memory.released or idle:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                with torch.inference_mode():
                    self._prefill_step()
                    if self.active:
                        self._decode_step()
            except Exception as e:  # keep serving: fail what was admitted, reset the batch
                log.exception("engine step failed")
                for s in self.active + [s for unit in self._units() for s in unit.seqs]:
                    s.error = f"internal engine error: {type(e).__name__}: {e}"
                    s.finish_reason = {"type": "abort", "message": s.error}
                    self._finish(s)
                self._reset_batch()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with torch.inference_mode():
                    fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _reset_batch(self) -> None:
        """Drop the running batch and every prompt being prefilled."""
        self.active = []
        self._prefilling.clear()
        self._carry = None
        try:
            self.runner.reset()
        except Exception:  # TP workers gone: nothing left to reset there (alive is False)
            log.exception("resetting the batch failed")

    def _finish(self, s: Sequence) -> None:
        s.finished_at = time.perf_counter()
        s.weight_version = self.weight_version
        if self.tokenizer is not None:
            ids = s.output_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=s.params.skip_special_tokens)
            matched = (s.finish_reason or {}).get("matched")
            if isinstance(matched, str) and not s.params.no_stop_trim and matched in text:
                text = text[: text.rfind(matched)]
            s.text = text
        with self._lock:
            self._rids.discard(s.rid)
        if s.on_done is not None:
            try:
                s.on_done(s)
            except Exception:  # a dead caller must not kill the engine
                log.exception("on_done callback failed")

    # ---- prefill --------------------------------------------------------------------------
    def _take(self, room: int) -> list[Sequence]:
        """Up to ``room`` waiting sequences, deficit round-robin over requests (lock held):
        the request in front takes up to :data:`FAIR_QUANTUM`, then goes to the back; one cut
        short by the room keeps the rest of its turn for the next admission."""
        taken: list[Sequence] = []
        while room > 0 and self._pending:
            waiting = self._pending[0]
            if waiting.credit == 0:
                waiting.credit = FAIR_QUANTUM
            k = min(room, waiting.credit, len(waiting.seqs))
            taken.extend(waiting.seqs.popleft() for _ in range(k))
            waiting.credit -= k
            room -= k
            if not waiting.seqs:
                self._pending.popleft()
            elif waiting.credit == 0:
                self._pending.rotate(-1)
        self._num_pending -= len(taken)
        return taken

    def _units(self) -> list[_Prefill]:
        """The prompts admitted and not yet wholly prefilled."""
        carry = [self._carry] if self._carry is not None else []
        return [*self._prefilling, *carry]

    def _prefill_step(self) -> None:
        """This iteration's prefill: up to ``chunked_prefill_size`` prompt tokens, from the
        queue of admitted prompts; one that does not fit what is left gets a chunk of it and
        waits, behind the prompts admitted next, for the next iteration."""
        budget = self.chunked_prefill_size or sys.maxsize
        self._admit(budget)
        if self._carry is not None:
            self._prefilling.append(self._carry)
            self._carry = None
        while self._prefilling and budget > 0:
            unit = self._prefilling[0]
            rows = _distinct(unit.seqs)  # forwarded rows: one per distinct prompt
            n = min(unit.length - unit.done, budget // rows)
            if n <= 0:  # its rows do not fit what is left: first in the next iteration
                break
            self._prefilling.popleft()
            budget -= n * rows
            try:
                last = self._prefill_chunk(unit, n)
                if last is None:
                    self._carry = unit
                    break
                self._complete(unit, last)
            except Exception as e:  # fail these prompts only; the running batch is intact
                log.exception("prefill failed")
                for seq in unit.seqs:
                    if seq.finish_reason is None and seq not in self.active:
                        seq.error = f"internal engine error in prefill: {type(e).__name__}: {e}"
                        seq.finish_reason = {"type": "abort", "message": seq.error}
                        self._finish(seq)
                self._drop_unit(unit)

    def _admit(self, budget: int) -> None:
        """Admit waiting sequences as prompt groups (equal lengths, at most
        ``max_prefill_tokens`` of distinct prompts a forward, a prompt's copies together),
        only as many as this iteration's ``budget`` can reach after the prompts already
        queued (always one where none is): the rest keep their round-robin places among the
        waiting requests. A copy of a prompt admitted in the same round costs nothing more."""
        backlog = sum(unit.left() for unit in self._prefilling)
        room = self.max_running - len(self.active) - sum(len(u.seqs) for u in self._units())
        taken: list[Sequence] = []
        seen: set[int] = set()
        with self._lock:
            while room > 0 and self._pending:
                head = self._pending[0].seqs[0]  # what _take(1) returns
                nxt = 0 if head.prompt_key in seen else len(head.prompt)
                if backlog > 0 and backlog + nxt > budget:
                    break
                got = self._take(1)
                taken.extend(got)
                seen.update(s.prompt_key for s in got)
                backlog += nxt
                room -= 1
        groups: dict[int, dict[int, list[Sequence]]] = {}  # length -> prompt -> its copies
        for s in taken:
            groups.setdefault(len(s.prompt), {}).setdefault(s.prompt_key, []).append(s)
        cap = min(self.max_prefill_tokens, budget)
        for length, by_prompt in groups.items():
            per = max(1, cap // length)  # distinct prompts a forward
            prompts = list(by_prompt.values())
            for i in range(0, len(prompts), per):
                seqs = [s for copies in prompts[i : i + per] for s in copies]
                self._prefilling.append(_Prefill(next(self._unit_keys), seqs))

    def _drop_unit(self, unit: _Prefill) -> None:
        """Forget a prompt group (its sequences are finished) and its partial cache."""
        if unit in self._prefilling:
            self._prefilling.remove(unit)
        if unit is self._carry:
            self._carry = None
        if unit.cached:
            unit.cached = 0
            try:
                self.runner.keep_prefill(unit.key, [])
            except Exception:  # TP workers gone: nothing left to drop there (alive is False)
                log.exception("dropping a partial prefill failed")

    def _prefill_chunk(self, unit: _Prefill, n: int) -> torch.Tensor | None:
        """Forward the next ``n`` prompt tokens of ``unit``'s rows; the last position's logits
        once the prompts are whole (None before).

        Equal prompts (the ``n`` copies of a request, a group's samples) are forwarded once:
        the partial cache holds one row per distinct prompt, ``unit.rows`` says each
        sequence's, and the copies share its logits (SGLang shares such a prefix through its
        radix cache). A GRPO group of 8 samples prefills its prompt once, not 8 times."""
        seqs, length = unit.seqs, unit.length
        start, end = unit.done, unit.done + n
        distinct: dict[tuple[int, ...], int] = {}  # prompt -> its row in the partial cache
        firsts: list[int] = []  # each distinct prompt's first sequence
        row_of: list[int] = []  # each sequence's row
        for j, s in enumerate(seqs):
            row = distinct.setdefault(tuple(s.prompt), len(firsts))
            if row == len(firsts):
                firsts.append(j)
            row_of.append(row)
        ids = torch.tensor([seqs[j].prompt[start:end] for j in firsts], dtype=torch.long)
        rows = None
        if unit.cached:
            kept = [unit.rows[j] for j in firsts]  # the cache rows the distinct prompts are
            rows = kept if kept != list(range(unit.cached)) else None
        want_input = [s.return_logprob and s.logprob_start_len >= 0 for s in seqs]
        # logits of the positions whose next token's logprob is asked for (input logprobs
        # from logprob_start_len on), and of the prompt's last one (the first output token)
        first = min(
            (max(s.logprob_start_len - 1, 0) for s, w in zip(seqs, want_input, strict=True) if w),
            default=length - 1,
        )
        keep = max(1, end - max(start, first))
        record = any(s.return_routed_experts for s in seqs)
        logits, routed = self.runner.prefill(unit.key, ids, length, keep, record, rows)
        self.prefill_chunks += 1
        unit.done, unit.cached, unit.rows = end, len(firsts), row_of
        if routed is not None:
            routed = routed[row_of]
        self._take_routed(seqs, routed)
        for j, s in enumerate(seqs):
            if want_input[j]:
                self._input_logprobs(s, logits[row_of[j]], end - logits.shape[1], end)
        if end != length:
            return None
        last = logits[:, -1, :]
        return last if len(firsts) == len(seqs) else last[row_of]

    def _complete(self, unit: _Prefill, last: torch.Tensor) -> None:
        """The prompts are prefilled: sample their first tokens; those that go on join the
        running batch with their cache rows."""
        seqs = unit.seqs
        live = [j for j, s in enumerate(seqs) if s.max_new > 0]
        for s in seqs:
            if s.max_new <= 0:
                s.finish_reason = {"type": "length", "length": 0}
                self._finish(s)
        if not live:
            self._drop_unit(unit)
            return
        last = last[live]
        seqs = [seqs[j] for j in live]
        tokens = self._next_tokens(last, seqs).tolist()
        keep = [j for j, s in enumerate(seqs) if not self._append(s, tokens[j])]
        # the kept rows of the prefill's cache join the running batch (left-padded)
        unit.cached = 0
        self.runner.keep_prefill(unit.key, [unit.rows[live[j]] for j in keep])
        self.active.extend(seqs[j] for j in keep)

    @staticmethod
    def _take_routed(seqs: list[Sequence], routed: torch.Tensor | None) -> None:
        """The rows of ``seqs`` that asked for routed experts get theirs from a forward."""
        if routed is None:
            return
        for s, rows in zip(seqs, routed, strict=True):
            if s.return_routed_experts:
                s.routed.append(rows.clone())  # not a view keeping the batch's alive

    @staticmethod
    def _input_logprobs(s: Sequence, logits: torch.Tensor, first: int, end: int) -> None:
        """Add the prompt logprobs that a chunk's ``logits`` (of positions ``[first, end)``)
        give to ``s.input_logprobs``: those of tokens ``logprob_start_len`` on (the first
        prompt token has none)."""
        if s.input_logprobs is None:
            s.input_logprobs = [[None, s.prompt[0], None]] if s.logprob_start_len == 0 else []
        lo = max(first, s.logprob_start_len - 1, 0)  # positions whose next token is reported
        hi = min(end, len(s.prompt) - 1)
        if lo >= hi:
            return
        temp = s.params.temperature if s.params.temperature >= GREEDY_EPS else 1.0
        lp = torch.log_softmax(logits[lo - first : hi - first].float() / temp, dim=-1)
        toks = s.prompt[lo + 1 : hi + 1]
        vals = lp.gather(1, torch.tensor(toks).unsqueeze(1)).flatten().tolist()
        s.input_logprobs.extend([v, t, None] for v, t in zip(vals, toks, strict=True))

    # ---- decode ---------------------------------------------------------------------------
    def _decode_step(self) -> None:
        bsz = len(self.active)
        ids = torch.tensor([[s.output_ids[-1]] for s in self.active], dtype=torch.long)
        record = any(s.return_routed_experts for s in self.active)
        last, routed = self.runner.decode(ids, record)
        self._take_routed(self.active, routed)
        self.steps += 1
        tokens = self._next_tokens(last, self.active).tolist()
        keep = [i for i, s in enumerate(self.active) if not self._append(s, tokens[i])]
        if len(keep) != bsz:
            self._select_rows(keep)

    def _select_rows(self, keep: list[int]) -> None:
        """Keep the running rows ``keep`` (none: the batch is gone; prefills go on)."""
        self.runner.select_rows(keep)
        self.active = [self.active[i] for i in keep]

    # ---- sampling -------------------------------------------------------------------------
    def _stop_ids(self, s: Sequence) -> frozenset[int]:
        ids = s.stop_ids
        if ids is None:  # made once: asked for each of its tokens
            found = set(s.params.stop_token_ids or [])
            if not s.params.ignore_eos:
                found |= self.eos_ids
            ids = s.stop_ids = frozenset(found)
        return ids

    def _adjust_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        logits = logits.float()
        for i, s in enumerate(seqs):
            p = s.params
            if p.logit_bias:
                for tok, bias in p.logit_bias.items():
                    logits[i, int(tok)] += bias
            if (p.frequency_penalty or p.presence_penalty) and s.output_ids:
                counts = torch.bincount(torch.tensor(s.output_ids), minlength=self.vocab_size)
                counts = counts[: logits.shape[1]].float()
                logits[i] -= (
                    p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
                )
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(s.prompt) | set(s.output_ids)))
                vals = logits[i, seen]
                logits[i, seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            if len(s.output_ids) < p.min_new_tokens:
                stops = [t for t in self._stop_ids(s) if t < logits.shape[1]]
                if stops:
                    logits[i, stops] = float("-inf")
        return logits

    def _next_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        logits = self._adjust_logits(logits, seqs)
        tokens, logprobs = self._sampler.sample(
            logits,
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [len(s.output_ids) for s in seqs],
        )
        want = [i for i, s in enumerate(seqs) if s.return_logprob]
        if want:
            idx = torch.tensor(want)
            vals = logprobs[idx, tokens[idx]].tolist()
            for i, v in zip(want, vals, strict=True):
                s = seqs[i]
                s.output_logprobs.append(v)
                if s.top_logprobs_num > 0:
                    tv, ti = logprobs[i].topk(min(s.top_logprobs_num, logprobs.shape[1]))
                    s.output_top.append(
                        [[a, b, None] for a, b in zip(tv.tolist(), ti.tolist(), strict=True)]
                    )
        return tokens

    def _append(self, s: Sequence, token: int) -> bool:
        """Record a sampled token; return True (and finish the sequence) if it ended."""
        s.output_ids.append(token)
        self.generated_tokens += 1
        n = len(s.output_ids)
        if n >= s.params.min_new_tokens and token in self._stop_ids(s):
            s.finish_reason = {"type": "stop", "matched": token}
        elif n >= s.max_new:
            s.finish_reason = {"type": "length", "length": n}
        elif (
            self.tokenizer is not None and s.params.stop_strings() and n >= s.params.min_new_tokens
        ):
            tail = self.tokenizer.decode(s.output_ids[-32:], skip_special_tokens=False)
            for stop in s.params.stop_strings():
                if stop in tail:
                    s.finish_reason = {"type": "stop", "matched": stop}
                    break
        if s.finish_reason is None:
            if s.on_token is not None:
                try:
                    s.on_token(s)
                except Exception:  # a dead stream must not kill the engine
                    log.exception("on_token callback failed")
            return False
        self._finish(s)
        return True

    def snapshot(self, s: Sequence) -> dict[str, Any]:
        """The cumulative response of an unfinished sequence (a streaming chunk)."""
        out = sequence_result(s)
        out["meta_info"]["weight_version"] = self.weight_version
        if self.tokenizer is not None:
            out["text"] = self.tokenizer.decode(
                s.output_ids, skip_special_tokens=s.params.skip_special_tokens
            )
        return out


def sequence_result(s: Sequence) -> dict[str, Any]:
    """The SGLang response object for one finished sequence."""
    meta: dict[str, Any] = {
        "id": s.rid,
        "finish_reason": s.finish_reason,
        "prompt_tokens": len(s.prompt),
        "completion_tokens": len(s.output_ids),
        "cached_tokens": 0,
        "weight_version": s.weight_version,
        "e2e_latency": round(max(s.finished_at - s.created, 0.0), 6),
    }
    if s.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(s.output_logprobs, s.output_ids, strict=False)
        ]
        meta["input_token_logprobs"] = s.input_logprobs or []
        if s.top_logprobs_num > 0:
            meta["output_top_logprobs"] = s.output_top
    if s.return_routed_experts and s.finish_reason is not None:
        routed = routed_experts(s)
        if routed is not None:
            meta["routed_experts"] = encode_routed_experts(routed)
    out: dict[str, Any] = {"output_ids": list(s.output_ids), "meta_info": meta}
    if s.text is not None:
        out["text"] = s.text
    return out


def routed_experts(s: Sequence) -> torch.Tensor | None:
    """The experts of tokens ``[routed_experts_start_len, seqlen - 1)`` as ``[tokens, layers,
    top_k]`` int32 (the last sampled token is never fed); None if the prompt never ran (a
    request aborted while queued)."""
    end = len(s.prompt) + len(s.output_ids) - 1
    if not s.routed:
        return None
    rows = torch.cat(s.routed) if len(s.routed) > 1 else s.routed[0]
    if rows.shape[0] < end:
        return None
    return rows[s.routed_experts_start_len : end]


__all__ = ["Engine", "QueueFullError", "Sequence", "routed_experts", "sequence_result"]
