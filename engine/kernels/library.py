"""kvarena's operators in torch's dispatcher (``torch.ops.kvarena.*``), so torch.compile traces
a forward pass through them as single opaque nodes instead of breaking the graph around them.

`define(schema, impl, fake)` declares one operator from its schema string, registers `impl` for
every backend (CompositeExplicitAutograd: the Python function dispatches on the tensors itself)
and `fake` for tracing (shapes and dtypes only). Mutated arguments are annotated in the schema
(``Tensor(a!) k_cache``), which is what functionalization and inductor read.

Why not ``torch.library.custom_op``: its Python wrapper costs a visible share of a small
decode step (at batch 1 a compiled SmolLM2 step makes 121 projection and 30 attention calls);
an op declared here adds a few microseconds. The measurement is in
results/benchmarks/cpu-kernels-notes.md.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIB = torch.library.Library("kvarena", "DEF")  # kept alive for the process: it owns the ops


def define(schema: str, impl: Callable, fake: Callable):
    """schema: ``"name(Tensor x, ...) -> Tensor"``. Returns the operator
    ``torch.ops.kvarena.name``."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kvarena::{name}", fake, lib=_LIB)
    return getattr(torch.ops.kvarena, name)
