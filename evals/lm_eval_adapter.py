"""lm-evaluation-harness on the paged engine: the `kvarena` model of lm-eval, under any KV policy.

    import lm_eval
    from evals.lm_eval_adapter import KvarenaLM
    lm = KvarenaLM("Qwen/Qwen3-8B", policy="snapkv", policy_args={"budget": 512})
    results = lm_eval.simple_evaluate(model=lm, tasks=["gsm8k"])
    results["config"]["kvarena"]          # the engine's run statistics

or `kvarena lm-eval -m MODEL -p POLICY -a key=value --tasks ...` (``main`` below), where every other
argument is lm-eval's own. Importing this module registers the model under the name ``kvarena``,
so ``simple_evaluate(model="kvarena", model_args={...})`` works too.

What each request type becomes on the engine (all requests of one call are submitted at once, so
continuous batching and prefix caching do the work):

- ``loglikelihood``: context tokens as the prompt, the continuation as ``forced_tokens`` with
  ``logprobs``. The log-likelihood is the sum of the forced tokens' log-probabilities; *is greedy*
  is whether each forced token was the argmax of its logits (read through the runner's logits
  hook). Tokenization and truncation follow lm-eval's ``hf`` backend exactly: trailing context
  spaces move to the continuation, an empty context is the prefix token (BOS, else EOS), and a pair
  longer than ``max_length + 1`` tokens loses tokens from the left. A forced continuation that
  contains EOS or a stop string is still scored to its end (the scheduler never stops on a forced
  token).
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens, each one a
  loglikelihood request, all windows of all documents in one engine call.
- ``generate_until``: the context left-truncated to ``max_length - max_gen_toks`` tokens, the stop
  strings plus the EOS text (as the ``hf`` backend does), temperature / top-p / top-k from the
  generation kwargs (greedy unless ``do_sample``), and a seed per request derived from the model's
  ``seed`` (or ``seed`` in the generation kwargs) and the request's own text, so a request draws
  the same tokens whatever else runs with it or in which order lm-eval sends it.

``max_length`` defaults to the engine's ``max_model_len - 1``: a scored pair of ``max_length + 1``
tokens then never reaches the engine's length limit before its last forced token.

Under a compressing policy the scores are those of the compressed cache, which is the point: the
same multiple-choice or perplexity task measures what a policy's evictions cost. The engine's run
statistics (average KV budget, capacity events, tokens/s per call) are returned by
``get_model_info`` and so land in lm-eval's results JSON under ``config.kvarena``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import zlib
from collections import Counter
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from engine.config import DEFAULT_MODEL
from engine.sampling import SamplingParams

MODEL_NAME = "kvarena"
DEFAULT_MAX_GEN_TOKS = 256
# Generation kwargs the engine honours; anything else is an error rather than silently ignored.
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "seed")


class AdapterError(ValueError):
    """A request or setting that the adapter cannot honour; the message names it."""


@register_model(MODEL_NAME)
class KvarenaLM(TemplateLM):
    """lm-eval's ``LM`` backed by ``engine.llm.LLM``.

    pretrained (alias ``model``): anything ``--model`` takes (HF directory, .gguf, hub id, the
        embedded default's name).
    policy / policy_args: the KV policy and its dataclass fields (a dict, a JSON object string, or
        ``key=value`` strings).
    max_length: longest scored sequence in tokens (default: the engine's max_model_len - 1).
    max_gen_toks: default most tokens for ``generate_until`` when a task does not say.
    add_bos_token: as in lm-eval's ``hf`` backend (None: the tokenizer's default).
    seed: base seed of sampled generations.
    llm: an already built ``LLM`` to use instead of loading one (its policy then applies).
    engine_kwargs: any other ``EngineConfig`` key (kv_cache_tokens, block_size, max_num_seqs, ...).
    batch_size / max_batch_size: accepted for lm-eval's CLI and unused: every request of a call
        is submitted at once and the engine batches continuously under ``max_num_seqs`` and
        ``max_num_batched_tokens``.
    device: lm-eval's device string ("cuda", "cuda:0", "cpu"); None or "auto" lets the engine
        choose (cuda when present, else cpu).
    """

    def __init__(self, pretrained: str | None = None, *, model: str | None = None,
                 policy: str = "full", policy_args: Any = None, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool | None = None,
                 seed: int = 1234, llm=None, batch_size: Any = None, max_batch_size: Any = None,
                 device: str | None = None, **engine_kwargs: Any) -> None:
        super().__init__()
        if llm is None:
            from engine.llm import LLM

            spec = pretrained if pretrained is not None else model
            if device not in (None, "", "auto"):
                engine_kwargs["device"] = str(device)
            llm = LLM(spec if spec is not None else DEFAULT_MODEL, policy=policy,
                      policy_args=parse_policy_args(policy_args), **engine_kwargs)
        elif engine_kwargs or policy_args:
            raise AdapterError("give engine settings or an llm, not both")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        limit = llm.engine_spec.max_model_len
        self._max_length = int(max_length) if max_length is not None else limit - 1
        if not 1 <= self._max_length < limit:
            raise AdapterError(f"max_length must be in [1, {limit - 1}] for this engine "
                               f"(max_model_len {limit}), got {max_length}")
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.seed = int(seed)
        self._device = llm.config.device
        self.runs: list[dict] = []
        self._budgets: list[float] = []

    # -- lm-eval's model properties ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.model_dir).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids as lm-eval's ``hf`` backend makes them (no BOS added twice)."""
        options = {}
        if add_special_tokens is not None:
            options["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            options["add_special_tokens"] = self.add_bos_token
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            options["add_special_tokens"] = False
        return self.tokenizer.encode(string, **options)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)

    # -- scoring ------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              request_type: str = "loglikelihood", **kwargs
                              ) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context_enc, continuation_enc) triples."""
        if not requests:
            return []
        prompts, params = [], []
        for _, context_enc, continuation_enc in requests:
            prompt, forced = self._scored_pair(context_enc, continuation_enc)
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.0, max_tokens=len(forced),
                                         forced_tokens=tuple(forced), logprobs=True))
        greedy = _GreedyProbe(params)
        with self.llm.watching_logits(greedy.observe):
            outputs = self._run(request_type, prompts, params)
        results = []
        for i, (request, out, p) in enumerate(zip(requests, outputs, params)):
            n = len(p.forced_tokens)
            if out.finish_reason != "forced" or len(out.token_logprobs) != n:
                raise AdapterError(
                    f"loglikelihood request {i} ended with {out.finish_reason!r} after "
                    f"{len(out.token_logprobs)} of {n} continuation tokens; raise kv_cache_tokens or "
                    f"lower max_length ({self.max_length})")
            result = (float(sum(out.token_logprobs)), greedy.all_greedy(i, n))
            results.append(result)
            if request[0] is not None:
                self.cache_hook.add_partial("loglikelihood", request[0], result)
        return results

    def _scored_pair(self, context_enc: list[int], continuation_enc: list[int]):
        """(prompt, forced) after the ``hf`` backend's left truncation to max_length + 1 tokens."""
        if not context_enc or not continuation_enc:
            raise AdapterError("a loglikelihood request needs a non-empty context and continuation")
        if len(continuation_enc) > self.max_length:
            raise AdapterError(f"continuation of {len(continuation_enc)} tokens is longer than "
                               f"max_length {self.max_length}")
        whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
        return whole[: len(whole) - len(continuation_enc)], list(continuation_enc)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context_enc, continuation_enc in map(
                    utils.make_disjoint_window,
                    utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                    prefix_token=self.prefix_token_id,
                                                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context_enc, continuation_enc))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm,
                                            request_type="loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ---------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            p, until, max_ctx = self._gen_params(context, gen_kwargs, eos)
            prompts.append(self.tok_encode(context)[-max_ctx:])
            params.append(p)
            stops.append(until)
        outputs = self._run("generate_until", prompts, params)
        texts = []
        for req, out, until in zip(requests, outputs, stops):
            text = postprocess_generated_text(out.text, until, None)
            texts.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _gen_params(self, context: str, gen_kwargs: dict, eos: str):
        if not isinstance(gen_kwargs, dict):
            raise AdapterError(f"generation kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        if kwargs.get("num_beams", 1) != 1:
            raise AdapterError(f"beam search is not supported (num_beams={kwargs['num_beams']})")
        kwargs.pop("num_beams", None)
        unknown = sorted(set(kwargs) - set(GEN_KWARGS))
        if unknown:
            raise AdapterError(f"generation kwargs {unknown} are not supported; supported: "
                               f"{list(GEN_KWARGS)} (and num_beams=1)")
        until = handle_stop_sequences(kwargs.get("until"), eos=eos)
        max_gen = int(kwargs["max_gen_toks"])
        max_ctx = self.max_length - max_gen
        if max_ctx <= 0:
            raise AdapterError(f"max_gen_toks {max_gen} leaves no room for the context within "
                               f"max_length {self.max_length}")
        sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0
        base = int(kwargs.get("seed", self.seed))
        key = json.dumps([context, gen_kwargs], sort_keys=True, default=str).encode()
        params = SamplingParams(
            temperature=float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
            top_p=float(kwargs.get("top_p", 1.0) or 1.0) if sampled else 1.0,
            top_k=int(kwargs.get("top_k", 0) or 0) if sampled else 0,
            seed=(base + zlib.crc32(key)) % (2 ** 31), max_tokens=max_gen,
            stop=tuple(s for s in until if s))
        return params, until, max_ctx

    # -- the engine and its statistics ----------------------------------------------------------
    def _run(self, kind: str, prompts: list[list[int]], params: list[SamplingParams]):
        outputs = self.llm.generate(prompts, params)
        stats = self.llm.last_stats
        self._budgets.extend(o.avg_kv_budget for o in outputs if o.avg_kv_budget is not None)
        self.runs.append({"request_type": kind, "num_requests": len(prompts),
                          "avg_kv_budget": stats.avg_kv_budget, "counts": dict(stats.counts),
                          "grow_ratio": stats.grow_ratio, "output_tokens": stats.output_tokens,
                          "wall_time": stats.wall_time, "tps": stats.tps,
                          "peak_pages": stats.peak_pages})
        return outputs

    def engine_stats(self) -> dict:
        """The run statistics of every engine call so far, and their totals."""
        counts: Counter[str] = Counter()
        for run in self.runs:
            counts.update(run["counts"])
        policy, spec = self.llm.policy, self.llm.engine_spec
        return {
            "model_dir": str(self.llm.model_dir),
            "policy": policy.name,
            "policy_args": _policy_config(policy),
            "max_length": self.max_length,
            "block_size": spec.block_size,
            "kv_pool_tokens": spec.num_pages * spec.block_size,
            "avg_kv_budget": statistics.fmean(self._budgets) if self._budgets else None,
            "events": dict(counts),
            "num_requests": sum(r["num_requests"] for r in self.runs),
            "wall_time": sum(r["wall_time"] for r in self.runs),
            "runs": list(self.runs),
        }

    def get_model_info(self) -> dict:
        return {MODEL_NAME: self.engine_stats()}


class _GreedyProbe:
    """Records, for each scored request, whether every forced token was its position's argmax.

    Keyed by the identity of the request's SamplingParams (the adapter makes one per request) and
    the output index, so a preempted and re-prefilled request overwrites rather than duplicates."""

    def __init__(self, params: list[SamplingParams]):
        self.index = {id(p): i for i, p in enumerate(params)}
        self.hits: dict[int, dict[int, bool]] = {i: {} for i in range(len(params))}

    def observe(self, items, logits) -> None:
        """An `LLM.watching_logits` hook: items of a step and their logits [rows, vocab],
        `item.rows` rows per item (a forced run scores several positions)."""
        top = iter(logits.argmax(dim=-1).tolist())
        for item in items:
            i = self.index.get(id(item.seq.params))
            forced = item.seq.params.forced_tokens
            for k in range(item.seq.num_output_tokens, item.seq.num_output_tokens + item.rows):
                best = next(top)
                if i is not None and k < len(forced):
                    self.hits[i][k] = best == forced[k]

    def all_greedy(self, i: int, n: int) -> bool:
        hits = self.hits[i]
        if len(hits) != n:
            raise AdapterError(f"request {i}: {len(hits)} of {n} positions were observed")
        return all(hits.values())


def _policy_config(policy) -> dict:
    import dataclasses

    if dataclasses.is_dataclass(policy):
        return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)
                if isinstance(getattr(policy, f.name), (int, float, str, bool, type(None)))}
    return {}


def parse_policy_args(value: Any) -> dict:
    """A dict, a JSON object string, ``key=value`` strings (a list, or one string joined by ';')
    or None -> a dict of policy arguments (strings are coerced by ``build_policy``)."""
    from engine.policies.base import parse_policy_args as parse_items

    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, (list, tuple)):
        return parse_items([str(v) for v in value])
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                loaded = json.loads(text)
            except ValueError as exc:
                raise AdapterError(f"policy_args {value!r} is not a JSON object: {exc}") from exc
            if isinstance(loaded, dict):
                return loaded
        return parse_items([s for s in text.split(";") if s.strip()])
    raise AdapterError(f"policy_args must be a dict, a JSON object or key=value strings, "
                       f"got {type(value).__name__}")


# -- `kvarena lm-eval` --------------------------------------------------------------------------------


def _own_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvarena lm-eval", add_help=False, allow_abbrev=False,
        description="Run lm-evaluation-harness on the paged engine under a KV policy. Every "
                    "argument not listed here is lm-eval's own (`lm-eval run`), passed through "
                    "unchanged; lm-eval's short -a is taken by --policy-arg here, so write "
                    "--model_args in full (engine settings such as kv_cache_tokens=4096 go there).")
    parser.add_argument("-m", "--model", default=DEFAULT_MODEL,
                        help="HF directory, .gguf file, hub id, or the embedded default's name.")
    parser.add_argument("-p", "--policy", action="append", default=[], metavar="POLICY",
                        help="KV policy name (repeatable: one lm-eval run per policy, each in its "
                             "own directory under --output_path; default: full).")
    parser.add_argument("-a", "--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="Policy argument (repeatable). With several --policy, key=value goes "
                             "to every listed policy that has the field and policy:key=value to "
                             "that one, as in kvarena eval.")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads.")
    parser.add_argument("-h", "--help", action="store_true", help="Show this help and lm-eval's.")
    return parser


def lm_eval_runs(argv: list[str]) -> tuple[argparse.Namespace, list[tuple[str, list[str]]]]:
    """Split ``kvarena lm-eval`` arguments into ours and, per policy, its label
    (``evals.results.labels.run_label``, as ``kvarena eval`` names run directories) and the
    ``lm-eval run`` argument list that evaluates the ``kvarena`` model under it.

    Every policy and its arguments are validated here, by building it, so a bad name or value is
    one AdapterError before lm-eval or the model loads. ``--output_path DIR`` becomes
    ``DIR/<label>`` for each run (lm-eval then adds its model directory), so the runs of several
    policies never share a directory; a ``.json`` output path gets ``<label>/`` before its name."""
    from engine.config import ConfigError
    from engine.policies.base import build_policy
    from evals.cli import split_policy_args
    from evals.results.labels import run_label

    ours, rest = _own_parser().parse_known_args(argv)
    if "-M" in rest:
        raise AdapterError("-M (lm-eval's --model) is set by kvarena lm-eval; pass the model "
                           "with --model/-m")
    policies = list(dict.fromkeys(ours.policy)) or ["full"]
    try:
        per_policy = split_policy_args(ours.policy_arg, policies)
        for policy in policies:
            build_policy(policy, per_policy[policy])
    except (ConfigError, ValueError) as e:
        raise AdapterError(str(e)) from None
    # lm-eval's own default device is cuda:0; the engine picks cuda when present, else cpu.
    device = [] if "--device" in rest or any(a.startswith("--device=") for a in rest) \
        else ["--device", "auto"]
    runs = []
    for policy in policies:
        label = run_label(policy, per_policy[policy])
        model_args = {"pretrained": ours.model, "policy": policy, "policy_args": per_policy[policy]}
        runs.append((label, ["run", *_output_per_run(rest, label), *device, "--model", MODEL_NAME,
                             "--model_args", json.dumps(model_args)]))
    return ours, runs


def _output_per_run(argv: list[str], label: str) -> list[str]:
    """``argv`` with lm-eval's output path (``--output_path``/``-o``, also ``--output_path=``)
    moved into a directory named ``label``."""
    from pathlib import Path

    def moved(value: str) -> str:
        path = Path(value)
        return str(path.parent / label / path.name if path.suffix == ".json" else path / label)

    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--output_path", "-o") and i + 1 < len(argv):
            out += [arg, moved(argv[i + 1])]
            i += 2
            continue
        if arg.startswith("--output_path="):
            arg = "--output_path=" + moved(arg.split("=", 1)[1])
        out.append(arg)
        i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    """``kvarena lm-eval``: lm-eval's CLI with the ``kvarena`` model, once per policy (writes
    lm-eval's results JSON, with the engine's statistics under ``config.kvarena``). Bad policies,
    policy arguments or models are an AdapterError before lm-eval starts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, runs = lm_eval_runs(argv)
    from lm_eval._cli import HarnessCLI

    cli = HarnessCLI()
    if ours.help:
        _own_parser().print_help()
        print("\nlm-eval's arguments (all accepted, except --model):\n")
        cli._parser.parse_args(["run", "--help"])
        return
    _check_model(ours.model)
    from lm_eval.utils import setup_logging

    from engine.threads import set_threads

    set_threads(ours.threads)
    setup_logging()
    for label, lm_argv in runs:
        if len(runs) > 1:
            print(f"== kvarena lm-eval: policy {label}", file=sys.stderr)
        cli.execute(cli._parser.parse_args(lm_argv))


def _check_model(model: str) -> None:
    """The model resolves (a local directory, a GGUF, the embedded default, a cached or
    downloadable hub id), else an AdapterError with the loader's words."""
    from engine.models.loader import ModelLoadError, resolve_model

    try:
        resolve_model(model)
    except ModelLoadError as e:
        raise AdapterError(str(e)) from None
