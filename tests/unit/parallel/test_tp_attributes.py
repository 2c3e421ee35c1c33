"""TP attributes from each linear layer's layout, not from the backend's marks
(``parallel/megatron_compat/tp_attributes.py``).

Transformer Engine is not installable here, so its marks are reproduced on the local tiny model:
every linear weight ``tensor_model_parallel=True`` (the replicated MLA down-projections, TE's
"duplicated" ``TELinear``, included) and routed-expert fc2 ``partition_dim=0`` (TE's marks under
explicit expert communication, expert TP or EP > 1). After the normaliser the attributes, Muon's
per-matrix split, its update and megatron's grad-norm de-duplication equal the untouched local
model's; without it they do not (at TP = expert TP = 2, on two gloo ranks). megatron's TE wrapper
classes themselves are checked through stand-ins with their qualified names.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from parallel.megatron_compat.tp_attributes import layout_of, normalize_tp_attributes
from parallel.initialize import free_port

TE = "megatron.core.extensions.transformer_engine"
DOWN_PROJS = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")


def _split(p) -> tuple:
    """What Muon and megatron's grad norm read: (TP-split?, dimension)."""
    tp = bool(getattr(p, "tensor_model_parallel", False))
    return tp, (p.partition_dim if tp else None)


def _te_marks(chunks, explicit_expert_comm: bool) -> None:
    """The attributes TE gives these layers: ``te.pytorch.Linear`` marks its weight split along
    dim 1 when its TE parallel_mode is "row", else dim 0; megatron passes parallel_mode None for a
    duplicated TELinear and for expert layers under explicit expert communication."""
    from megatron.core.post_training.modelopt.layers import Linear as DuplicatedLinear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, ColumnParallelLinear) or isinstance(module, DuplicatedLinear):
                te_mode_row = False
            elif isinstance(module, RowParallelLinear):
                te_mode_row = not (explicit_expert_comm and ".experts." in f".{name}.")
            else:
                continue
            w = module.weight
            w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, int(te_mode_row), 1


def _unnormalised_local_chunks(par):
    """The tiny model as the local spec builds it, with the normaliser switched off."""
    import model_providers.glm5.model.provider as provider
    from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config

    cfg = GLM5Config()
    normalize, provider.normalize_tp_attributes = provider.normalize_tp_attributes, lambda chunks: None
    try:
        return provider.build_model_chunks(cfg, to_transformer_config(cfg, par, PrecisionConfig()), "local")
    finally:
        provider.normalize_tp_attributes = normalize


# --- one rank: the attributes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_chunks(one_rank):
    from parallel.config import ParallelConfig

    return _unnormalised_local_chunks(ParallelConfig())


def _attributes(chunks) -> dict:
    return {f"{i}.{n}": _split(p) for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def test_local_layers_keep_their_own_attributes(local_chunks):
    want = _attributes(local_chunks)
    normalize_tp_attributes(local_chunks)
    assert _attributes(local_chunks) == want
    layer = "0.decoder.layers.1."
    assert want[layer + "self_attention.linear_q_down_proj.weight"] == (False, None)
    assert want[layer + "self_attention.linear_proj.weight"] == (True, 1)
    assert want[layer + "mlp.experts.local_experts.0.linear_fc2.weight"] == (True, 1)


def test_te_marks_are_replaced_by_the_layers_layout(local_chunks):
    normalize_tp_attributes(local_chunks)
    want = _attributes(local_chunks)
    _te_marks(local_chunks, explicit_expert_comm=True)
    marked = _attributes(local_chunks)
    down = {n for n in want if n.endswith(DOWN_PROJS)}  # 2 x (4 decoder layers + MTP)
    expert_fc2 = {n for n in want if ".local_experts." in n and n.endswith("linear_fc2.weight")}
    assert len(down) == 2 * 5 and len(expert_fc2) == 8 * 4  # 8 experts x (3 MoE layers + MTP)
    assert {n for n in want if marked[n] != want[n]} == down | expert_fc2
    normalize_tp_attributes(local_chunks)
    assert _attributes(local_chunks) == want


def test_build_model_chunks_normalises_every_backend(one_rank, monkeypatch):
    import model_providers.glm5.model.provider as provider
    from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
    from parallel.config import ParallelConfig

    seen = []
    monkeypatch.setattr(provider, "normalize_tp_attributes", lambda chunks: seen.append(chunks))
    cfg = GLM5Config()
    chunks = provider.build_model_chunks(cfg, to_transformer_config(cfg, ParallelConfig(), PrecisionConfig()),
                                         "local")
    assert len(seen) == 1 and seen[0] is chunks


# --- megatron's TE wrappers, through stand-ins with their qualified names ----------------------------


class _TELayer(torch.nn.Module):
    """A TE-backed layer with TE's marks (by TE's own ``parallel_mode``): every weight split,
    along dim 1 when "row", else dim 0; biases split along dim 0 when "column", else unmarked;
    a fused layer norm unmarked."""

    def __init__(self, parallel_mode, names=("weight",)):
        super().__init__()
        self.parallel_mode = parallel_mode
        for n in names:
            weight = n.startswith("weight")
            p = torch.nn.Parameter(torch.zeros(6, 4) if weight else torch.zeros(6))
            if weight or (n.startswith("bias") and parallel_mode == "column"):
                p.tensor_model_parallel, p.partition_stride = True, 1
                p.partition_dim = 1 if parallel_mode == "row" and weight else 0
            self.register_parameter(n, p)


def _te_class(name: str, base: type) -> type:
    return type(name, (base,), {"__module__": TE, "__qualname__": name})


TELinear = _te_class("TELinear", _TELayer)
TEColumnParallelLinear = _te_class("TEColumnParallelLinear", TELinear)
TERowParallelLinear = _te_class("TERowParallelLinear", TELinear)
TELayerNormColumnParallelLinear = _te_class("TELayerNormColumnParallelLinear", _TELayer)
TEGroupedLinear = _te_class("TEGroupedLinear", _TELayer)
TEColumnParallelGroupedLinear = _te_class("TEColumnParallelGroupedLinear", TEGroupedLinear)
TERowParallelGroupedLinear = _te_class("TERowParallelGroupedLinear", TEGroupedLinear)

GROUPED = tuple(f"weight{i}" for i in range(3))
#: (module, {param: split after normalising}); TE parallel_mode None is what megatron passes for
#: "duplicated" and for expert layers under explicit expert communication
TE_CASES = {
    "duplicated TELinear": (TELinear(None), {"weight": (False, None)}),
    "column TELinear": (TELinear("column", ("weight", "bias")), {"weight": (True, 0), "bias": (True, 0)}),
    "row TELinear": (TELinear("row", ("weight", "bias")), {"weight": (True, 1), "bias": (False, None)}),
    "column": (TEColumnParallelLinear("column"), {"weight": (True, 0)}),
    "row": (TERowParallelLinear("row", ("weight", "bias")), {"weight": (True, 1), "bias": (False, None)}),
    "expert column, explicit comm": (TEColumnParallelLinear(None), {"weight": (True, 0)}),
    "expert row, explicit comm": (TERowParallelLinear(None), {"weight": (True, 1)}),
    "layernorm column": (TELayerNormColumnParallelLinear("column", ("layer_norm_weight", "weight")),
                         {"layer_norm_weight": (False, None), "weight": (True, 0)}),
    "grouped fc1, explicit comm": (TEColumnParallelGroupedLinear(None, GROUPED),
                                   dict.fromkeys(GROUPED, (True, 0))),
    "grouped fc2, explicit comm": (TERowParallelGroupedLinear(None, GROUPED),
                                   dict.fromkeys(GROUPED, (True, 1))),
    "grouped fc2": (TERowParallelGroupedLinear("row", GROUPED), dict.fromkeys(GROUPED, (True, 1))),
}


@pytest.mark.parametrize("case", list(TE_CASES))
def test_te_wrapper_layouts(case):
    module, want = TE_CASES[case]
    normalize_tp_attributes([module])
    assert {n: _split(p) for n, p in module.named_parameters()} == want


def test_only_linear_layers_have_a_layout():
    for other in (torch.nn.Embedding(4, 4), torch.nn.LayerNorm(4), TEGroupedLinear(None)):
        assert layout_of(other) is None, other
    assert layout_of(torch.nn.Linear(4, 4)) == "replicated"


# --- two ranks: Muon's split and update, megatron's grad norm ----------------------------------------


def _muon_view(chunks, grads: dict, weights: dict) -> tuple[dict, dict]:
    """Muon's spec per matrix (gathered?, dimension, head blocks) and its update from ``weights``
    with gradients ``grads`` (one step, fresh momentum); the weights are restored."""
    from pretrain.optim.matrices import muon_matrices
    from pretrain.optim.muon_adamw import MuonAdamW, MuonHyper

    specs = muon_matrices(chunks, "per_head")
    params = list(specs)
    for p in params:
        p.grad = grads[specs[p].name].clone()
    opt = MuonAdamW([{"params": params, "muon": True}], matrices=specs, hyper=MuonHyper(), lr=0.1,
                    weight_decay=0.0)
    opt.step()
    updates = {}
    for p in params:
        updates[specs[p].name] = weights[specs[p].name] - p.detach()
        p.data.copy_(weights[specs[p].name])
        p.grad = None
    return ({s.name: [s.tp_group is not None, s.tp_dim, s.block_rows] for s in specs.values()}, updates)


def _grad_norm(chunks, grads: dict) -> float:
    """megatron's grad norm over the Muon matrices: a gradient counts on every TP rank when
    ``param_is_not_tensor_parallel_duplicate``, else on TP rank 0 only."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    total = torch.zeros(())
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if name in grads and param_is_not_tensor_parallel_duplicate(p):
                total += grads[name].square().sum()
    dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    return float(total.sqrt())


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from parallel.config import ParallelConfig
    from parallel.initialize import DistEnv, initialize
    from pretrain.optim.matrices import muon_matrices

    par = ParallelConfig(tp=2, sequence_parallel=True)  # expert TP = TP = 2
    initialize(par, seed=7, env=DistEnv(rank, 2, rank, "127.0.0.1", port, "torchrun"))
    try:
        chunks = _unnormalised_local_chunks(par)
        names = {s.name: p for p, s in muon_matrices(chunks, "per_head").items()}
        weights = {n: p.detach().clone() for n, p in names.items()}
        grads = {}
        for n, p in names.items():  # replicated matrices get the same gradient on both TP ranks
            seed = zlib.crc32(n.encode()) + (rank if _split(p)[0] else 0)
            grads[n] = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))

        views = {}
        views["local"] = (*_muon_view(chunks, grads, weights), _grad_norm(chunks, grads))
        _te_marks(chunks, explicit_expert_comm=True)
        views["te"] = (*_muon_view(chunks, grads, weights), _grad_norm(chunks, grads))
        normalize_tp_attributes(chunks)
        views["normalised"] = (*_muon_view(chunks, grads, weights), _grad_norm(chunks, grads))

        ref = views["local"][1]
        result = {}
        for kind, (specs, updates, norm) in views.items():
            result[kind] = {
                "specs": specs,
                "grad_norm": norm,
                "max_update_diff": {n: float((u - ref[n]).abs().max()) for n, u in updates.items()},
                "update_norm": {n: float(u.norm()) for n, u in updates.items()},
            }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_views(tmp_path_factory):
    from tests.support import core_gate

    out = tmp_path_factory.mktemp("tp_attributes")
    with core_gate.whole_machine():
        torch.multiprocessing.spawn(_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.heavy
def test_te_marked_model_gets_the_local_muon_split_update_and_grad_norm(two_rank_views):
    for rank, views in enumerate(two_rank_views):
        local, te, normalised = views["local"], views["te"], views["normalised"]
        assert normalised["specs"] == local["specs"], rank
        assert max(normalised["max_update_diff"].values()) <= 1e-6, rank
        assert normalised["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-12)

        # without the normaliser: the down-projections are gathered as [A; A] and the routed
        # experts' fc2 along the wrong dimension; the grad norm counts the down-projections twice
        wrong = {n for n in local["specs"] if te["specs"][n] != local["specs"][n]}
        down = {n for n in local["specs"] if n.endswith(DOWN_PROJS)}
        fc2 = {n for n in local["specs"] if n.endswith("linear_fc2.weight") and ".local_experts." in n}
        assert len(down) == 10 and len(fc2) == 32 and wrong == down | fc2
        for n in wrong:
            assert local["specs"][n][:2] in ([False, None], [True, 1]) and te["specs"][n][:2] == [True, 0]
            assert te["max_update_diff"][n] > 1e-3, n
        for n in down:  # Newton-Schulz of [A; A] is [O; O] / sqrt(2)
            assert te["update_norm"][n] / local["update_norm"][n] == pytest.approx(2 ** -0.5, rel=1e-3), n
        assert te["grad_norm"] > local["grad_norm"] * (1 + 1e-3)
