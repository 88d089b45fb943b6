"""Eager vs compiled decode step on the embedded model, side by side in one process.

Both engines are loaded once and warmed up (the compiled one builds its batch-1 and bucketed
graphs), then each workload runs eager, compiled, compiled, eager; the best of each mode is
printed, and the greedy tokens of both modes are compared. This is the measurement behind
`engine.config.COMPILE_DEFAULT["cpu"]` (results/benchmarks/cpu-kernels-notes.md).

    .venv/bin/python scripts/compile_ab.py      # on a quiet machine (check `uptime` first)
"""

import time

import torch

from engine.llm import LLM
from engine.sampling import SamplingParams

PROMPT_TOKENS, NEW_TOKENS, BATCH = 128, 128, 32


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params)
    return len(prompts) * params.max_tokens / (time.perf_counter() - start)


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(100, 40000, (BATCH, PROMPT_TOKENS), generator=g).tolist()
    single = torch.randint(100, 40000, (1, PROMPT_TOKENS), generator=g).tolist()
    pool = BATCH * (PROMPT_TOKENS + NEW_TOKENS + 64) + 512
    llms = {mode: LLM(None, compile=mode, kv_cache_tokens=pool, max_num_seqs=BATCH)
            for mode in (False, True)}
    warm = SamplingParams(temperature=0, max_tokens=3)
    for llm in llms.values():  # both compiled graphs (batch 1, the buckets) exist before timing
        llm.generate([batch[0][:4]], warm)
        llm.generate([batch[0][:4], batch[1][:3]], warm)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    check = SamplingParams(temperature=0, max_tokens=16)
    for name, prompts in (("batch 1", single), (f"batch {BATCH}", batch)):
        best = {False: 0.0, True: 0.0}
        for mode in (False, True, True, False):
            tps = timed(llms[mode], prompts, params)
            best[mode] = max(best[mode], tps)
            print(f"{name} compile={mode}: {tps:.1f} tok/s", flush=True)
        same = [o.token_ids for o in llms[False].generate(prompts[:4], check)] == \
            [o.token_ids for o in llms[True].generate(prompts[:4], check)]
        print(f"{name}: best eager {best[False]:.1f}, compiled {best[True]:.1f} tok/s "
              f"(compiled / eager {best[True] / best[False]:.2f}); same greedy tokens: {same}")


if __name__ == "__main__":
    main()
