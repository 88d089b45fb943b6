"""Running evaluations: one task x one policy on the paged engine, resumable, graded as it goes.

    from evals.run.runner import run_eval
    from evals.run.settings import EvalSettings

    outcome = run_eval(EvalSettings(task="gsm8k", policy="snapkv"))

Modules, in the order a run uses them:

    settings.py     EvalSettings, EvalOutcome, EvalHooks, EvalError, resolve_policy_args (the budget)
    plan.py         the task, its problems, the (uid, sample) keys, render_requests (the prompts)
    matched_budget.py  Kara's comparison protocol: each sample's budget from a finished Kara run
    engines.py      the loaded engine, cached across runs whose engine settings match
    fidelity.py     drift from FullKV: the cached reference and the policy's forced pass
    progress.py     TokenProgress: each pass's output tokens against the most it can generate
    grader.py       BackgroundGrader: grading off the engine's thread, sample lines appended
    records.py      sample lines, event counts, metrics.json recomputed from the files
    positions.py    NLL, delta-NLL and KV by position in the document (metrics.json's by_position)
    runner.py       run_eval / run_many: the steps above, in order, under the run directory's lock
    distributed.py  the same runs on Ray workers, sharded by (problem, sample)
    sweep.py        the minimum-sufficient-budget study (GrowPage Sec. 2) over budget runs
"""
