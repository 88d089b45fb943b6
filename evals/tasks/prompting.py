"""Render a task's chat messages into the model's prompt text through its chat template."""

from __future__ import annotations

import warnings
from typing import Any, Sequence


def supports_thinking_switch(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template reads ``enable_thinking`` (Qwen3 style)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: look at all of them
        template = " ".join(t for t in template.values() if isinstance(t, str))
    return isinstance(template, str) and "enable_thinking" in template


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, str]], thinking: bool | None = None) -> str:
    """The prompt text for ``messages``, ending where the assistant's reply begins.

    ``thinking``: ``None`` leaves the template's default; ``True``/``False`` switches Qwen3's
    thinking mode through ``enable_thinking``.  Asking for thinking from a template without
    the switch is an error (the run would silently not think); asking to *disable* it there
    is a no-op (such models do not think in the Qwen3 sense).

    A tokenizer without a chat template (a base model) gets a plain ``role: content``
    transcript and a warning, so runs still work but the choice is visible.
    """
    if not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
    kwargs: dict[str, Any] = {}
    if thinking is not None:
        if supports_thinking_switch(tokenizer):
            kwargs["enable_thinking"] = bool(thinking)
        elif thinking:
            raise ValueError(
                "thinking=True needs a chat template with an enable_thinking switch (e.g. Qwen3); "
                "this tokenizer's template has none. Use thinking=None or False for this model."
            )
    if not getattr(tokenizer, "chat_template", None):
        warnings.warn("the tokenizer has no chat template; using a plain 'role: content' prompt",
                      stacklevel=2)
        body = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return body + "\n\nassistant:"
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True, **kwargs
    )
    if not isinstance(text, str):  # some versions return a dict-like when asked for dicts
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text
