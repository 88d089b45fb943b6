"""The LLM facade: `LLM(model, **config).generate(prompts, params)`.

Outputs come back in submission order, each with text, token ids, finish reason, token counts,
first-token/finish times, TPOT, capacity trace and capacity events; `last_stats` holds the run's
statistics (engine.stats). `stream()` yields outputs as requests finish (for resumable evaluations);
`steps()` yields after every engine step.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator
from typing import Sequence as Seq

from engine import threads
from engine.block_manager import BlockManager
from engine.config import ConfigError, EngineConfig
from engine.kept_trace import KeptTrace
from engine.models.loader import load_tokenizer, resolve_model
from engine.policies.base import EngineSpec, KVPolicy, build_policy
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, prompt_unfit
from engine.sequence import Sequence
from engine.stats import RequestOutput, RunStats, StepRecord, run_stats

Prompt = str | list[int]


@dataclass(frozen=True)
class StepDone:
    """One engine step of `LLM.steps`: every request's output tokens so far, and the outputs of
    the requests that finished in the step (submission indices in `RequestOutput.index`)."""

    output_tokens: int
    finished: list[RequestOutput]


class LLM:
    """The engine: load a model once, then generate under any KV policy.

    `LLM(model=None, **config)`: `model` is a local HF directory, a GGUF file, a hub id, or None for
    the embedded default (SmolLM2-135M-Instruct); every other keyword is an `EngineConfig` field
    (engine/config.py documents each; an unknown one is an error), for example `policy="snapkv"`,
    `policy_args={"budget": 128}`, `block_size=32`, `kv_cache_tokens=16384`, `max_num_seqs=16`,
    `dtype="float32"`, `device="cuda"`, `seed=0`.

    To compare policies without reloading the weights, swap them with `use_policy`:

        llm = LLM()
        for name in ("full", "snapkv"):
            llm.use_policy(name, budget=64) if name != "full" else llm.use_policy(name)
            print(name, llm.generate("Hello", SamplingParams(temperature=0, max_tokens=32))[0].text)
    """

    def __init__(self, model: str | None = None, **kwargs):
        if model is not None:
            kwargs["model"] = str(model)
        self.config = EngineConfig.from_kwargs(**kwargs)
        threads.govern_unset()
        self.model_dir = resolve_model(self.config.model,
                                       need_weights=self.config.load_format != "dummy")
        self.tokenizer = load_tokenizer(self.model_dir)
        policy = self._policy(self.config.policy, self.config.policy_args)
        policy.prepare(self.config.block_size)  # before signals(): they may depend on it
        self.runner = ModelRunner(self.config, self.model_dir, policy.signals())
        self.eos_ids = self._eos_ids()
        self.last_stats: RunStats | None = None
        self.last_scheduler: Scheduler | None = None
        self._bind(policy)

    # -- what callers may read ------------------------------------------------------------------
    @property
    def engine_spec(self) -> EngineSpec:
        """The engine's shape as policies see it: block size, layers, query and KV heads, head
        dimension, pages in the KV pool, and the longest sequence (prompt plus output)."""
        r = self.runner
        return EngineSpec(r.block_size, r.num_layers, r.num_q_heads, r.num_kv_heads, r.head_dim,
                          r.num_pages, r.max_model_len)

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding: every token id is below it."""
        return int(self.runner.hf_config.vocab_size)

    @property
    def native_kernels(self) -> bool:
        """Whether the decode step runs the C kernels (engine/kernels/cpu_native.py)."""
        return self.runner.native_kernels

    @property
    def compiled(self) -> bool:
        """Whether decode steps run through the compiled step (`EngineConfig.compile`)."""
        return self.runner.graph is not None

    @property
    def counters(self) -> Mapping[str, int]:
        """The current (or last) run's scheduler counters, read-only and live while `stream`
        runs (`Scheduler.counters`: preemptions, fallbacks, each capacity decision, prefix-cache
        hit tokens). Empty before the first run."""
        return MappingProxyType(self.last_scheduler.counters if self.last_scheduler else {})

    def use_policy(self, policy: str | KVPolicy, **args) -> KVPolicy:
        """Run the next generations under `policy` (a registered name with its dataclass fields as
        keyword arguments, or a policy instance), keeping the loaded weights and KV pool.

        The policy is built (unknown names and fields are errors), prepared for the block size,
        its signals are given their pools (re-allocated only when they differ from the current
        ones), it is bound to the engine's shape, and the block manager starts afresh: a cold
        prefix cache, as a new engine has, so a run never reuses the pages of the run before it.
        Returns the bound policy."""
        built = self._policy(policy, args)
        built.prepare(self.config.block_size)
        self.runner.use_signals(built.signals())
        self._bind(built)
        return built

    def why_unfit(self, n_tokens: int) -> str | None:
        """Why a prompt of `n_tokens` tokens cannot run on this engine (the model's context or the
        whole KV pool is too small), or None when it fits. The scheduler refuses such a prompt
        with the same words."""
        spec = self.engine_spec
        return prompt_unfit(n_tokens, spec.max_model_len, spec.num_pages, spec.block_size)

    @contextmanager
    def watching_logits(self, hook: Callable[[list, Any], None]) -> Iterator[None]:
        """Within the block, `hook(items, logits)` sees every step's sampled rows (the work items
        and their logits [rows, vocab], valid during the call only; each item owns `item.rows`
        consecutive rows, more than one for a forced run, row j scoring its output token
        seq.num_output_tokens + j) after any hook already set; the previous hook is back
        afterwards, also on an error."""
        runner = self.runner
        previous = runner.logits_hook

        def chained(items, logits):
            if previous is not None:
                previous(items, logits)
            hook(items, logits)

        runner.logits_hook = chained
        try:
            yield
        finally:
            runner.logits_hook = previous

    def _bind(self, policy: KVPolicy) -> None:
        spec = self.engine_spec
        policy.bind(spec)
        self.policy = policy
        # Outlives each generate() call, so prefix-cached pages are reused across calls too.
        self.block_manager = BlockManager(spec.num_pages, spec.block_size,
                                          self.config.enable_prefix_caching)

    @staticmethod
    def _policy(policy: str | KVPolicy, args: dict) -> KVPolicy:
        if isinstance(policy, KVPolicy):
            if args:
                raise ConfigError("policy arguments only apply when the policy is given by name")
            return policy
        if not isinstance(policy, str):
            raise ConfigError(f"policy must be a name or a KVPolicy, got {type(policy).__name__}")
        return build_policy(policy, args)

    def _eos_ids(self) -> set[int]:
        ids = set()
        gen = getattr(self.runner.hf_config, "eos_token_id", None)
        for value in (self.tokenizer.eos_token_id, gen):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(value)
        return ids

    # -- public API -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 on_step: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in submission order.
        on_step(output_tokens_so_far, finished_requests) is called after every engine step."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        outputs: list[RequestOutput | None] = [None] * len(batch)
        for out in self.stream(batch, params, on_step):
            outputs[out.index] = out
        return outputs

    def stream(self, prompts: Seq[Prompt],
               params: SamplingParams | Seq[SamplingParams] | None = None,
               on_step: Callable[[int, int], None] | None = None) -> Iterator[RequestOutput]:
        """Yield each request's output as soon as it finishes. `last_scheduler` is this run's
        scheduler from the start (its counters are live); `last_stats` is set when the run ends,
        also when it is stopped early (an exception such as Ctrl-C, or closing the generator)."""
        finished = 0
        with closing(self.steps(prompts, params)) as steps:
            for step in steps:
                yield from step.finished
                finished += len(step.finished)
                if on_step is not None:
                    on_step(step.output_tokens, finished)

    def steps(self, prompts: Seq[Prompt],
              params: SamplingParams | Seq[SamplingParams] | None = None) -> Iterator[StepDone]:
        """`stream`, one engine step per item: after each step, the requests' output tokens so
        far and the outputs of those that finished in it (usually none). A caller can run two
        engines a step or a page at a time side by side (`kvarena bench forced`); `last_stats`
        as in `stream`."""
        seqs = self._make_sequences(prompts, params)
        self.runner.reseed_noise()
        scheduler = Scheduler(self.config, self.runner, self.policy, self.block_manager,
                              self.eos_ids, self._decode)
        self.last_scheduler = scheduler
        self.last_stats = None
        index = {seq.seq_id: i for i, seq in enumerate(seqs)}
        for seq in seqs:
            scheduler.add(seq)
        t0 = time.perf_counter()
        steps: list[StepRecord] = []
        outputs: list[RequestOutput] = []
        forward = 0.0
        try:
            while scheduler.has_unfinished():
                threads.adapt()
                items = scheduler.schedule()
                prefills = sum(it.prefill for it in items)
                step = StepRecord(len(scheduler.running), scheduler.bm.num_used,
                                  len(items) - prefills, threads.current(), prefills)
                steps.append(step)
                if items:
                    start = time.perf_counter()
                    tokens = self.runner.run(items)
                    step.seconds = time.perf_counter() - start
                    forward += step.seconds
                    scheduler.postprocess(items, tokens)
                elif scheduler.worker is not None and scheduler.worker.busy:
                    scheduler.collect_compactions(wait=True)
                finished = [RequestOutput.from_sequence(index[seq.seq_id], seq, self._text(seq), t0)
                            for seq in scheduler.drain_finished()]
                outputs.extend(finished)
                yield StepDone(sum(s.num_output_tokens for s in seqs), finished)
        finally:
            scheduler.shutdown()
            self.last_stats = run_stats(outputs, steps, scheduler.events, scheduler.counters,
                                        time.perf_counter() - t0, forward, scheduler.compaction_seconds)

    # -- helpers --------------------------------------------------------------------------------
    def _make_sequences(self, prompts, params) -> list[Sequence]:
        if not prompts:
            raise ConfigError("generate() needs at least one prompt")
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            ids = (self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str)
                   else list(prompt))
            if not ids:
                raise ConfigError(f"prompt {i} is empty: a request needs at least one token")
            ids = self._token_ids(ids, f"prompt {i}")
            self._token_ids(p.forced_tokens, f"the forced tokens of prompt {i}")
            seed = p.seed if p.seed is not None else self.config.seed + i
            seq = Sequence(ids, p, seed)
            if self.config.trace_kept:
                seq.kept_trace = KeptTrace()
            seqs.append(seq)
        return seqs

    def _token_ids(self, ids: Seq[int], what: str) -> list[int]:
        """``ids`` as ints; ConfigError unless each is an integer the model's embedding has a row
        for (an id past it would fail deep in the forward pass as an IndexError)."""
        vocab = self.vocab_size
        out = []
        for t in ids:
            try:
                value = None if isinstance(t, bool) else operator.index(t)
            except TypeError:
                value = None
            if value is None or not 0 <= value < vocab:
                raise ConfigError(f"{what} holds token id {t!r}, outside the model's vocabulary of "
                                  f"{vocab} ids (0 to {vocab - 1})")
            out.append(value)
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, seq: Sequence) -> str:
        return seq.text if seq.text is not None else self._decode(seq.output_token_ids)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **kwargs)
