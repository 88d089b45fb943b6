"""Benchmark tasks: a registry by name (``TASKS``, ``get_task``), prompts, per-task defaults.

Registered: ``gsm8k``, ``math500``, ``amc23``, ``aime24``, ``livecodebench``, ``niah``, ``mixed``,
``longdoc``, ``longdoc-needle``.
"""

# Importing a task module registers it.
from evals.tasks import (  # noqa: F401
    aime24,
    amc23,
    gsm8k,
    livecodebench,
    longdoc,
    longdoc_needle,
    math500,
    mixed,
    niah,
)
from evals.tasks.base import (
    MATH_SYSTEM_PROMPT,
    SCALES,
    TASKS,
    HubSource,
    LocalLayout,
    Task,
    TaskDefaults,
    cpu_preset,
    get_task,
    register_task,
    table1_tasks,
    task_title,
)
from evals.tasks.prompting import render_prompt, supports_thinking_switch

__all__ = [
    "TASKS", "get_task", "register_task", "Task", "TaskDefaults", "HubSource", "LocalLayout",
    "SCALES", "cpu_preset", "table1_tasks", "task_title", "MATH_SYSTEM_PROMPT", "render_prompt",
    "supports_thinking_switch",
]
