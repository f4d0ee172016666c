"""Which tensor inputs an op writes in place.

torch.export's training IR keeps in-place updates in the graph (``add_`` on batch
norm's ``num_batches_tracked``, ``batch_norm`` updating its running statistics) and
returns no mutated buffers. Written into a resharded copy, such an update would be
lost: the buffer the program reads next step keeps its old value. So a written input
must arrive exactly as its producer holds it (the solver links those edges to equal
placements, and no reshard is ever inserted on them).
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.capture.graph import TensorMeta
from autopar.rules.batch_norm import updated_running_stats
from autopar.rules.strategy import OpCall

aten = torch.ops.aten


def _written_names(call: OpCall) -> set[str]:
    """Schema argument names the op writes: marked ``Tensor(a!)``, or known to be written
    by an op whose schema hides it."""
    names: set[str] = set()
    schema = getattr(call.target, "_schema", None)
    if schema is not None:
        names = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    if call.target is aten.batch_norm.default:
        names.update(updated_running_stats(call))
    return names


def written_inputs(call: OpCall) -> frozenset[int]:
    """Indices (in ``OpCall.tensor_inputs`` order) of the tensor inputs written in place."""
    written = _written_names(call)
    if not written:
        return frozenset()
    schema = call.target._schema
    named: list[tuple[str, Any]] = [(schema.arguments[i].name if i < len(schema.arguments) else "", a)
                                    for i, a in enumerate(call.args)]
    named += list(call.kwargs.items())
    found: list[bool] = []  # same traversal as OpCall.tensor_inputs
    for name, value in named:
        if isinstance(value, TensorMeta):
            found.append(name in written)
        elif isinstance(value, (list, tuple)):
            found.extend(name in written for v in value if isinstance(v, TensorMeta))
    return frozenset(i for i, w in enumerate(found) if w)
