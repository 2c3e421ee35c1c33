"""Two real gloo ranks at TP=2 (+SP) build the tiny GLM-5 model: every parameter that megatron
does not shard over TP (norms, router weight, MoE expert bias, ...) must be bit-identical on both
ranks right after construction, and every TP-sharded one must hold different shards.

This is what the CPU RNG emulation has to get right: megatron initialises replicated weights from
the default generator (seeded identically on every rank) and TP shards from per-rank streams or
slices of one master weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.initialize import free_port

pytestmark = pytest.mark.heavy


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.config import ParallelConfig
    from parallel.initialize import DistEnv, initialize

    par = ParallelConfig(tp=2, sequence_parallel=True)
    initialize(par, seed=1234, env=DistEnv(rank, 2, rank, "127.0.0.1", port, "torchrun"))
    try:
        cfg = GLM5Config()
        chunks = build_model_chunks(cfg, to_transformer_config(cfg, par, PrecisionConfig()), "local")
        tensors = {}
        for i, chunk in enumerate(chunks):
            for name, p in chunk.named_parameters():
                tensors[f"{i}.{name}"] = (p.detach(), bool(getattr(p, "tensor_model_parallel", False)))
            for name, b in chunk.named_buffers():
                if name.endswith("expert_bias"):
                    tensors[f"{i}.{name}"] = (b, False)

        layout = {n: (list(t.shape), str(t.dtype), tp) for n, (t, tp) in tensors.items()}
        layouts = [None, None]
        dist.all_gather_object(layouts, layout)
        assert layouts[0] == layouts[1], "the ranks built different parameter sets or shapes"

        result = {"replicated_equal": [], "replicated_differ": [], "sharded_equal": [], "sharded_differ": []}
        stats = {}
        for name in sorted(tensors):
            t, tp = tensors[name]
            gathered = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(gathered, t.contiguous())
            same = torch.equal(gathered[0], gathered[1])
            kind = "sharded" if tp else "replicated"
            result[f"{kind}_{'equal' if same else 'differ'}"].append(name)
            stats[name] = float(t.float().std()) if t.numel() > 1 else 0.0
        result["std"] = stats
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(result))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def replica_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_replicas")
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    return json.loads((out / "result.json").read_text())


def test_replicated_parameters_are_bit_identical_across_tp_ranks(replica_report):
    assert replica_report["replicated_differ"] == []
    names = replica_report["replicated_equal"]
    assert any(n.endswith("router.weight") for n in names), names
    assert any(n.endswith("router.expert_bias") for n in names), names
    assert any(n.endswith("final_layernorm.weight") for n in names), names
    assert any(n.endswith("input_layernorm.weight") for n in names), names


def test_router_weight_is_random_not_constant(replica_report):
    """Equality of a constant tensor proves nothing: the router weight must be randomly drawn."""
    std = replica_report["std"]
    routers = [n for n in replica_report["replicated_equal"] if n.endswith("router.weight")]
    assert routers and all(std[n] > 1e-3 for n in routers), {n: std[n] for n in routers}


def test_tp_sharded_parameters_differ_across_tp_ranks(replica_report):
    assert replica_report["sharded_equal"] == []
    names = replica_report["sharded_differ"]
    assert any(n.endswith("embedding.word_embeddings.weight") for n in names), names
    assert any(n.endswith("output_layer.weight") for n in names), names
    assert any("self_attention.linear_proj.weight" in n for n in names), names
    assert any(".experts." in n for n in names), names
