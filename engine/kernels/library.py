"""kvarena's operators in torch's dispatcher (``torch.ops.kvarena.*``), so torch.compile traces
a forward pass through them as single opaque nodes instead of breaking the graph around them.

`define(schema, impl, fake)` declares one operator from its schema string, registers `impl` for
every backend (CompositeExplicitAutograd: the Python function dispatches on the tensors itself)
and `fake` for tracing (shapes and dtypes only). Mutated arguments are annotated in the schema
(``Tensor(a!) k_cache``), which is what functionalization and inductor read.

Why not ``torch.library.custom_op``: its Python wrapper costs a visible share of a small
decode step. Measured on the 2-core machine (1 token, 2 threads, inference mode): the packed
[576, 576] projection through a custom_op took 76 us against 55 us called directly, and the
store-and-attend op 118-147 us against 40 us for the kernels it wraps; an op declared here adds
~3-5 us. At batch 1 a compiled SmolLM2 step makes 121 projection and 30 attention calls: about
5 ms of a ~45 ms step went to the wrappers.
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
