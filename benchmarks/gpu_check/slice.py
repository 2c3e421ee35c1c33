"""A real-width GLM-5 slice, forward + backward, next to the planner's prediction."""

from __future__ import annotations

import importlib
import statistics
import time

import torch

from benchmarks.gpu_check.common import _sync
from benchmarks.gpu_check.tiny import _FixedBatch


#: routed experts per MoE layer of the GPU slice: one EP16 rank's share of GLM-5's 256 (the H200
#: preset's 4K layout). With 32 the 32K sparse slice needs 73.5 GiB of an H100's 79.6 by the
#: planner (layers without TE; 92%); with 16, 69.0 GiB (87%; TE layers 60.3 GiB)
SLICE_EXPERTS = 16
#: the share of a GPU's memory the planner's peak for a slice may take (10% stays free)
SLICE_MEMORY_SHARE = 0.9


def slice_overrides(device: str, mode: str, seq: int) -> list[str]:
    """The slice's Hydra overrides: GLM-5 (conf/model/glm5_744b.yaml) with 2 MoE layers of
    :data:`SLICE_EXPERTS` experts and no MTP on a GPU; the tiny GLM-5 with 2 layers on CPU."""
    model = (["model=glm5_744b", "model.num_layers=2", "model.first_k_dense=0",
              f"model.num_experts={SLICE_EXPERTS}",
              # one GPU, no EP overlap: the whole MoE layer recomputed, as before megatron 0.19
              # made the model's default moe_act (the slice's experts need not be grouped)
              "model.recompute_modules=[mla_up_proj,moe]"]
             if device == "cuda" else ["model=glm5_tiny", "model.num_layers=2", "model.first_k_dense=1",
                                       "parallel.cpu_emulation=strict"])
    return [*model, "model.mtp_num_steps=0", f"model.dsa.mode={mode}", "precision=bf16", "curriculum=none",
            f"trainer.seq_length={seq}", "trainer.micro_batch_size=1", "trainer.global_batch_size=1"]


def node_cluster(device: str) -> str:
    """The cluster preset of this node's GPU (H200, else H100); h200_141gb on CPU."""
    if device == "cuda" and "H200" not in torch.cuda.get_device_name(0):
        return "h100_80gb"
    return "h200_141gb"


def planner_prediction(rc, name: str, backend: str) -> dict:
    """The planner's step time of ``rc`` on one GPU of the node's cluster preset, less the
    optimizer step and DP time: its forward + backward prediction for one micro-batch; and its
    peak memory: the bf16 weights and their bf16 gradients (no DDP, no optimizer) plus the
    activation peak of ``backend``'s layers (:func:`planner.activations.activation_bytes`)."""
    from model_providers.glm5.counting.size import model_size
    from parallel.config import check_layout
    from planner.activations import activation_bytes
    from planner.cluster import load_cluster
    from planner.step_time import step_time

    cluster = load_cluster(name, {"nodes": 1, "gpus_per_node": 1})
    m, t = rc.model, rc.trainer
    layout, problems = check_layout(rc.parallel, world_size=1, num_layers=m.num_layers,
                                    num_attention_heads=m.num_attention_heads, num_experts=m.num_experts,
                                    seq_length=t.seq_length, micro_batch_size=t.micro_batch_size,
                                    global_batch_size=t.global_batch_size, mtp_num_steps=m.mtp_num_steps)
    if layout is None:
        raise RuntimeError(f"planner layout: {problems}")
    st = step_time(rc, layout, cluster)
    weights_and_grads = 2 * 2 * model_size(m).total
    peak = weights_and_grads + activation_bytes(rc, layout, 0, backend).peak
    return {"cluster": name, "fwd_bwd_s": round(st.total_s - st.optimizer_s - st.dp_s, 5),
            "compute_s": round(st.compute_s, 5), "elementwise_s": round(st.elementwise_s, 5),
            "launch_s": round(st.launch_s, 5), "backend": backend,
            "peak_memory_gib": round(peak / 2**30, 2), "gpu_memory_gib": cluster.gpu_memory_gib}


def run_slice(device: str, mode: str, seq: int, reps: int) -> dict:
    """Forward + backward of one sequence through megatron's schedule (the training step's
    forward_step and loss; no DDP, no optimizer) of the slice built from the composed config."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from data_pipeline.batches import micro_batches
    from model_providers.glm5.counting.flops import flops_per_token
    from model_providers.glm5.model.config import to_transformer_config
    from model_providers.glm5.model.provider import build_model_chunks
    from parallel.initialize import initialize
    from pretrain.config.schema import compose, to_run_config
    from pretrain.step import forward_step

    overrides = slice_overrides(device, mode, seq)
    rc = to_run_config(compose(overrides))
    m = rc.model
    initialize(rc.parallel, seed=1234)
    tcfg = to_transformer_config(m, rc.parallel, rc.precision)
    backend = m.layer_backend
    if backend == "auto":
        backend = "te" if device == "cuda" and importlib.util.find_spec("transformer_engine") else "local"
    chunks = build_model_chunks(m, tcfg, backend)
    data = _FixedBatch(m.vocab_size, seq, 1)
    batch = next(micro_batches(data, 0, 1, 1, 0, 1))
    fb = get_forward_backward_func()

    def step():
        for c in chunks:
            c.zero_grad(set_to_none=True)
        losses = fb(forward_step_func=forward_step, data_iterator=iter([batch]), model=chunks,
                    num_microbatches=1, seq_length=seq, micro_batch_size=1, forward_only=False)
        return losses

    losses = step()  # warm-up: compiles, allocator
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        losses = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    lm = losses[0]["lm"].double().cpu()
    loss = float(lm[0] / lm[1])
    seconds = statistics.median(times)
    flop = flops_per_token(m, seq).total * seq
    out = {"overrides": overrides, "backend": backend, "dsa_mode": mode, "seq": seq,
           "params": sum(p.numel() for c in chunks for p in c.parameters()), "lm_loss": loss,
           "fwd_bwd_s": round(seconds, 4), "tflops": round(flop / seconds / 1e12, 2)}
    if device == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    pred = planner_prediction(rc, node_cluster(device), backend)
    out["planner"] = pred
    out["measured_over_planner"] = round(seconds / pred["fwd_bwd_s"], 3) if pred["fwd_bwd_s"] else None
    del chunks
    if device == "cuda":
        torch.cuda.empty_cache()
    if not loss == loss:
        raise RuntimeError(f"non-finite slice loss {loss}")
    return out
