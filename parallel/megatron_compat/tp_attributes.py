"""The tensor-parallel split of every linear layer's parameters, written onto them from what the
layer is, so that the TP attributes mean the same under every layer backend: written as a
correction of the marks megatron-core 0.16.1's Transformer Engine layers left, kept on 0.19.2 as a
guard (called by the model provider on every chunk it builds; refuses another megatron-core
release, whose classes it names).

Muon gathers a TP-sharded matrix along ``partition_dim`` before orthogonalising it
(``pretrain.optim.matrices``), and megatron's grad norm counts a gradient on every TP rank only
when ``tensor_model_parallel`` is set (``param_is_not_tensor_parallel_duplicate``), else on TP
rank 0 only. megatron's local layers set these attributes right. Transformer Engine does not:
``te.pytorch.Linear`` / ``GroupedLinear`` mark every weight ``tensor_model_parallel=True`` with
``partition_dim = 1 if their TE parallel_mode == "row" else 0``, and megatron hands TE
parallel_mode None both for a ``"duplicated"`` (replicated) ``TELinear`` (MLA's q/kv
down-projections) and for expert layers whose TP/EP communication it does itself (expert TP or EP
> 1). On 0.16.1 replicated weights then read as split along dim 0 (Muon would orthogonalise
[A; A], the grad norm counted them TP times) and row-parallel expert fc2 as split along dim 0
instead of 1. megatron-core 0.19.2 re-marks them after TE's init (a duplicated ``TELinear``'s
parameters ``tensor_model_parallel=False``; expert layers from their own parallel mode,
``_set_expert_parameter_attributes``), but leaves TE's ``partition_dim`` 0 on the duplicated
weights, where this sets -1.

The layout is therefore taken from the module's class (megatron's local and TE wrapper classes,
matched by qualified name through the class hierarchy because TE is optional), and for a bare
``TELinear`` from the TE ``parallel_mode`` it kept (None = duplicated):

========================================================  =========================================
column: weights split along dim 0, biases along dim 0      ``ColumnParallelLinear``,
                                                           ``TEColumnParallelLinear``,
                                                           ``TELayerNormColumnParallelLinear``,
                                                           ``TEColumnParallelGroupedLinear``
row: weights split along dim 1, biases replicated          ``RowParallelLinear``,
                                                           ``TERowParallelLinear``,
                                                           ``TERowParallelGroupedLinear``
replicated: nothing split                                  ``TELinear`` with parallel_mode None,
                                                           any ``torch.nn.Linear`` (the local
                                                           duplicated linear, the DSA indexer's)
========================================================  =========================================

Only parameters named ``weight``/``bias`` (``weight0``... for grouped GEMMs) are touched;
``partition_stride`` is kept for split ones. Modules of other classes (embeddings, norms, the
router) keep megatron's own attributes.
"""

from __future__ import annotations

import re

import torch

from parallel.megatron_compat.version import check_megatron_core

COLUMN, ROW, REPLICATED = "column", "row", "replicated"

_TE = "megatron.core.extensions.transformer_engine"
_LOCAL = "megatron.core.tensor_parallel.layers"
_BY_CLASS = {
    f"{_LOCAL}.ColumnParallelLinear": COLUMN,
    f"{_LOCAL}.RowParallelLinear": ROW,
    f"{_TE}.TEColumnParallelLinear": COLUMN,
    f"{_TE}.TELayerNormColumnParallelLinear": COLUMN,
    f"{_TE}.TEColumnParallelGroupedLinear": COLUMN,
    f"{_TE}.TERowParallelLinear": ROW,
    f"{_TE}.TERowParallelGroupedLinear": ROW,
}
_TE_LINEAR = f"{_TE}.TELinear"
_TE_MODES = {"column": COLUMN, "row": ROW, None: REPLICATED}
_LINEAR_PARAM = re.compile(r"(weight|bias)\d*")


def layout_of(module: torch.nn.Module) -> str | None:
    """``column``, ``row``, ``replicated``, or None for a module that is not a linear layer."""
    for cls in type(module).__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in _BY_CLASS:
            return _BY_CLASS[name]
        if name == _TE_LINEAR:
            return _TE_MODES[module.parallel_mode]
    return REPLICATED if isinstance(module, torch.nn.Linear) else None


def _mark(param: torch.Tensor, dim: int | None) -> None:
    if dim is None:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = False, -1, 1
    else:
        param.tensor_model_parallel, param.partition_dim = True, dim
        param.partition_stride = getattr(param, "partition_stride", 1)


def normalize_tp_attributes(model_chunks) -> None:
    """Set ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` of every linear
    layer's weights and biases in ``model_chunks`` from its layout (see the module docstring)."""
    check_megatron_core(__file__)
    for chunk in model_chunks:
        for module in chunk.modules():
            layout = layout_of(module)
            if layout is None:
                continue
            for name, param in module.named_parameters(recurse=False):
                kind = _LINEAR_PARAM.fullmatch(name)
                if kind is None:
                    continue
                if layout == COLUMN:
                    _mark(param, 0)
                elif layout == ROW:
                    _mark(param, 1 if kind.group(1) == "weight" else None)
                else:
                    _mark(param, None)
