"""Estimated time of one training step of a stage on a cluster: compute + exposed communication.

Per micro-batch, each pipeline rank computes its decoder layers (and, on the ranks the layout
gives them, the MTP module and the output heads) on its share of the tokens -- TP and CP split
every layer's work but the lightning indexer's, which each TP rank repeats; EP spreads the routed
experts' -- at the cluster's peak times an efficiency per kind of work
(:func:`model_providers.glm5.counting.flops.layer_work`, recomputed forwards included):

- linear layers at the bf16 (tf32 for fp32 runs) peak, or with ``precision.fp8`` at the fp8 peak
  times ``FP8_RECIPE_RATE`` of the recipe (the output heads stay bf16: megatron's output layer is
  not a Transformer Engine layer); the routed experts' share times ``moe_imbalance``;
- element-wise work (norms, residual adds, RoPE, SwiGLU, router, token permutes, cross entropy,
  the weight-gradient accumulation, FP8 quantisation of linear inputs and gradients) as HBM traffic: ``ELEMENTWISE`` passes per token, fused or
  unfused as the parallel preset's fusion switches say, at ``hbm_gbps x hbm_efficiency``;
- ``launch_gap_us`` of idle GPU per layer forward (recomputed ones too).

Communication, each exposed but for the share its overlap switch hides:

- TP (tp > 1): per layer, forward all-gather + reduce-scatter of the activations around attention
  and around the dense FFN (MoE layers with expert TP 1 need none: the dispatcher moves tokens),
  the same in backward, again for recomputed forwards; the output heads gather the hidden states.
  ``parallel.tp_comm_overlap`` hides ``tp_overlap`` of it.
- EP (ep > 1): per MoE layer, dispatch and combine, forward and backward, again when the MoE
  forward is recomputed, times ``moe_imbalance``. The ``alltoall`` dispatcher sends one copy per
  routed expert (the share of peers on other nodes over the network, the rest over NVLink, at
  ``alltoall_efficiency``); the ``flex`` dispatcher (DeepEP / HybridEP) sends a token over the
  network once per destination node and forwards it inside the node over NVLink
  (:func:`bins_hit`: the expected nodes and GPUs a token's experts sit on, group-limited routing
  included), at ``flex_rdma_efficiency`` / ``flex_nvlink_efficiency``.
  ``overlap_moe_expert_parallel_comm`` hides ``ep_overlap`` of it in the schedule's steady
  1F1B phase (none in the interleaved warm-up and cool-down), at most the rank's compute.
- CP (cp > 1): per attention layer, the all-gather of the kv latent (kv_lora_rank + rope values
  per token) and of the indexer keys (DSA warm-up / sparse), reduce-scattered back in backward.
- PP: point-to-point sends of the activations and their gradients between stages.

The slowest pipeline rank sets the pace: its busy time per micro-batch times the micro-batches of
a step; the pipeline bubble adds ``(pp - 1) / (vpp * m)`` of that. After the last micro-batch the
data-parallel gradient reduction (distributed optimizer: fp32 gradient reduce-scatter + parameter
all-gather; otherwise an fp32 all-reduce; Muon with the distributed optimizer adds its fp32
all-gather of the Muon matrices' direction shards) and the embedding/MTP copies' all-reduce: ``overlap_grad_reduce``
hides ``dp_overlap`` of the reduction behind the last micro-batch's backward and the cool-down
half of the bubble, ``overlap_param_gather`` of the gather behind the first forward and the
warm-up half. Then the optimizer step: its element-wise traffic (Adam: ~30 bytes per element a
rank steps, 22 with bf16 moments) and Muon's Newton-Schulz (``ns_steps`` quintic iterations on
every matrix a rank owns a part of, gathered whole, at the fp32 CUDA-core or bf16 peak).
A collective over ranks on several nodes runs at the nodes' aggregate network bandwidth (each GPU
has its own NIC); one inside a node at NVLink bandwidth.

Not modelled: stragglers, the optimizer's host work, activation offloading, CUDA graphs.
``StepTime.assumptions`` lists what is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GB = 1e9

#: FP8 GEMM rate of a recipe relative to per-tensor scaling (delayed / current): blockwise
#: (1x128 activations, 128x128 weights; Hopper) and MXFP8 (1x32 blocks; Blackwell) quantise more.
#: Megatron-Bridge performance summary, 25.09 container: DeepSeek-V3 on 1,024 H100, 338 TFLOP/s
#: per GPU with current scaling, 330 with blockwise; Llama-3 8B on 8 B200, 29,994 tokens/s/GPU
#: with current scaling, 29,388 with MXFP8.
FP8_RECIPE_RATE = {"delayed": 1.0, "blockwise": 330 / 338, "mxfp8": 29388 / 29994}

#: HBM passes per token of one layer's element-wise work, forward + backward: (unfused, fused,
#: the parallel switch that fuses it; None: never fused in this pipeline). A pass moves one value
#: of the op's width once (read or write). Unfused: megatron-core's torch ops as counted on
#: 0.16.1 (0.19.2's router keeps fp32 to its end and its permute sorts with argsort: not
#: recounted), each reading its inputs and writing its output; fused: one kernel each way.
#: Widths (values per token): norms 2h + q_lora + kv_lora; residual adds 2h; RoPE the queries
#: and keys, 2 n (qk_nope + qk_rope); SwiGLU the FFN width (dense ffn; shared experts; routed:
#: top-k x moe_ffn); the router fp32 scores over the experts; permutes top-k x h; cross entropy
#: fp32 logits over the vocabulary, per output head.
ELEMENTWISE = {
    "norms": (5, 5, None),  # Transformer Engine's RMSNorm: read x, write y; read x, dy, write dx
    "residual": (6, 6, None),  # add: read 2, write 1; its gradient: read 2, write 1
    "swiglu": (20, 8, "bias_activation_fusion"),  # silu, product, gate and its gradients; probs in MoE
    "rope": (12, 4, "apply_rope_fusion"),  # rotate-half, cos/sin products, cat of nope and rope
    "router": (28, 6, "moe_router_fusion"),  # sigmoid, bias, group top-k, masks, scatter, aux loss
    "permute": (14, 8, "moe_permute_fusion"),  # index/sort, unpermute with probs, scatter-add
    "cross_entropy": (15, 1.5, "cross_entropy_loss_fusion"),  # fp32 upcast, max, exp, sum, grad
}
#: the forward's share of those passes (a recomputed forward repeats it)
FORWARD_SHARE = 0.4
#: bytes per trained parameter per micro-batch that an unfused weight-gradient accumulation adds:
#: the bf16 weight gradient read again, the fp32 main_grad read and written
#: (``gradient_accumulation_fusion`` accumulates inside the GEMM)
GRAD_ACCUMULATION_BYTES = 10
#: bytes per stepped element of the optimizer step: fp32 grad read, fp32 main param, exp_avg and
#: exp_avg_sq read and written, bf16 param written (bf16 moments: 4 of each moment's 8)
OPTIMIZER_BYTES = 30
#: Muon with the distributed optimizer: the all-gathered fp32 buffer of all Muon matrices, written
#: by the all-gather and read back by Newton-Schulz (per unsharded element; the rank's own segment,
#: packed before it, is 1/dp of that again and counted as the elements a rank steps)
MUON_ASSEMBLY_BYTES = 8
#: FP8 (Transformer Engine): bytes per value of each linear layer's input (forward) and output
#: gradient (backward) to quantise it: read bf16 (2), write the row- and column-wise fp8 copies
#: the forward and the weight gradient use (2)
FP8_CAST_BYTES = 4
FP32 = 4


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step, by what the slowest pipeline rank waits for (exposed time only)."""

    compute_s: float  #: matrix products (linear layers, attention core, indexer)
    tp_s: float
    ep_s: float
    pp_bubble_s: float
    cp_s: float
    dp_s: float
    total_s: float
    tokens_per_s_per_gpu: float
    mfu: float  #: Megatron-accounting FLOPs per second per GPU over the bf16 peak
    assumptions: dict = field(default_factory=dict)
    mfu_exact: float = 0.0  #: the same with the exact count (DSA sparse: far below Megatron's)
    pp_p2p_s: float = 0.0  #: pipeline point-to-point sends (in total_s)
    micro_batches: int = 0  #: per pipeline per step
    slowest_rank: int = 0  #: the pipeline rank that sets the pace
    elementwise_s: float = 0.0  #: HBM-bound element-wise work (in total_s)
    launch_s: float = 0.0  #: launch gaps (in total_s)
    optimizer_s: float = 0.0  #: the optimizer step: element-wise work and Muon's Newton-Schulz
    hidden_s: float = 0.0  #: communication hidden behind compute by the overlap switches (not in total_s)


def _group_time(nbytes: float, size: int, stride: int, cluster, efficiency: float) -> float:
    """A ring all-gather / reduce-scatter whose result is ``nbytes`` over ``size`` ranks placed
    ``stride`` apart in rank order (8 consecutive ranks share a node)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    gpn = cluster.gpus_per_node
    nvlink = (size - 1) / size * nbytes / (cluster.nvlink_gbps * GB * efficiency)
    if stride * size <= gpn:
        return nvlink
    per_node = max(1, min(size, gpn // stride))  # group members sharing a node
    nodes = size / per_node
    network = (nodes - 1) / nodes * nbytes / (per_node * cluster.internode_gbps * GB * efficiency)
    return max(network, nvlink if per_node > 1 else 0.0)


def _alltoall_time(nbytes: float, size: int, stride: int, cluster) -> float:
    """One all-to-all in which each rank sends ``nbytes`` spread evenly over ``size`` peers."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    local = max(1, min(size, cluster.gpus_per_node // stride)) if stride <= cluster.gpus_per_node else 1
    eff = cluster.alltoall_efficiency
    intra = nbytes * (local - 1) / size / (cluster.nvlink_gbps * GB * eff)
    inter = nbytes * (size - local) / size / (cluster.internode_gbps * GB * eff)
    return max(intra, inter)


def bins_hit(experts: int, topk: int, bins: int, groups: int = 1, group_topk: int = 1) -> float:
    """Expected number of ``bins`` (equal contiguous ranges of the experts: the EP ranks, or the
    nodes they sit on) holding at least one of a token's ``topk`` experts, routing uniform (as
    forced balance makes it) and group-limited: the token picks ``group_topk`` of ``groups``
    contiguous expert groups, then its experts among theirs (DeepSeek-V3's node-limited routing)."""
    if bins <= 1:
        return float(bins)
    if experts % bins:
        raise ValueError(f"{experts} experts do not split evenly over {bins} ranks or nodes")
    per_bin = experts // bins
    if groups <= 1 or group_topk >= groups or experts % groups or (
            bins <= groups and groups % bins) or (bins > groups and bins % groups):
        return bins * (1 - math.comb(experts - per_bin, topk) / math.comb(experts, topk))
    per_group = experts // groups
    pool = group_topk * per_group  # the experts a token chooses among
    if bins <= groups:  # a bin holds whole groups: j of them chosen (hypergeometric)
        g = groups // bins
        miss = sum(math.comb(g, j) * math.comb(groups - g, group_topk - j) / math.comb(groups, group_topk)
                   * math.comb(pool - j * per_group, topk) / math.comb(pool, topk)
                   for j in range(min(g, group_topk) + 1))
    else:  # a bin lies inside one group
        chosen = group_topk / groups
        miss = 1 - chosen + chosen * math.comb(pool - per_bin, topk) / math.comb(pool, topk)
    return bins * (1 - miss)


def _flex_time(tokens: float, h_bytes: float, m, ep: int, etp: int, cluster) -> float:
    """One flex (DeepEP / HybridEP) dispatch (or combine) of ``tokens`` tokens of ``h_bytes``
    each from every rank of an EP group: over the network once per destination node other than
    its own, then inside each node over NVLink to the destination GPUs."""
    gpn = cluster.gpus_per_node
    span = ep * etp
    groups, gtopk = m.moe_router_groups, m.moe_router_group_topk
    gpus = bins_hit(m.num_experts, m.moe_topk, ep, groups, gtopk) * (ep - 1) / ep
    nvlink = tokens * gpus * h_bytes / (cluster.nvlink_gbps * GB * cluster.flex_nvlink_efficiency)
    if span <= gpn:
        return nvlink
    nodes = span // gpn
    remote = bins_hit(m.num_experts, m.moe_topk, nodes, groups, gtopk) * (nodes - 1) / nodes
    rdma = tokens * remote * h_bytes / (cluster.internode_gbps * GB * cluster.flex_rdma_efficiency)
    return max(rdma, nvlink)


def _rank_layers(layout, pp: int) -> list[list[int]]:
    """Decoder layer indices (0-based) of each pipeline rank; chunk c of the model order belongs
    to rank c % pp."""
    ranks = [[] for _ in range(pp)]
    start = 0
    for c, n in enumerate(layout.layers_per_stage):
        ranks[c % pp].extend(range(start, start + n))
        start += n
    return ranks


def _piece_rank(layout, pp: int, piece: str) -> int:
    """The pipeline rank holding ``piece`` (embedding | mtp | loss): its model chunk modulo pp
    (``parallel.pipeline_layout``; without one the first / last chunk)."""
    chunks = len(layout.layers_per_stage)
    default = 0 if piece == "embedding" else chunks - 1
    c = getattr(layout, f"{piece}_chunk", default)
    return (chunks - 1 if c is None or c < 0 else c) % pp


class _Model:
    """Per-layer work and parameter counts of one stage's model, each kind computed once."""

    def __init__(self, rc):
        from model_providers.glm5.counting.flops import layer_work, mtp_work, output_head_work

        m, L, tp, cp = rc.model, rc.trainer.seq_length, rc.parallel.tp, rc.parallel.cp
        self.m = m
        self._work = {}
        for i in range(m.num_layers):
            key = self.kind(i)
            if key not in self._work:
                self._work[key] = layer_work(m, L, i, tp, cp)
        self.mtp = mtp_work(m, L, tp, cp)
        self.heads = output_head_work(m, L, tp)

    def kind(self, i: int) -> tuple:
        return (i == 0, bool(self.m.num_experts) and i >= self.m.first_k_dense)

    def work(self, i: int):
        return self._work[self.kind(i)]

    def is_moe(self, i: int) -> bool:
        return self.kind(i)[1]


@dataclass
class _Grads:
    """Trained parameters of a pipeline rank whose gradients DP reduces, per GPU: those split
    over TP (``dense``) and over EP x expert TP (``expert``), and of each the Muon matrices."""

    dense: float = 0.0
    dense_muon: float = 0.0
    expert: float = 0.0
    expert_muon: float = 0.0

    def add_layer(self, m, moe: bool, tp: int, ep_etp: int) -> None:
        """One transformer layer, as its DSA mode trains it (dense: not the indexer; warm-up:
        only the indexer, replicated over TP)."""
        from model_providers.glm5.counting.flops import attention_matmul_params

        d, h, mode = m.dsa, m.hidden_size, m.dsa.mode
        if mode not in ("dense", "none"):  # none: the model has no indexer
            index = d.index_heads * d.index_head_dim * m.q_lora_rank + d.index_head_dim * h \
                + d.index_heads * h
            self.dense += index + 2 * d.index_head_dim
            self.dense_muon += index
        if mode == "warmup":
            return
        mla = attention_matmul_params(m)
        norms = 2 * h + m.q_lora_rank + m.kv_lora_rank
        if moe:
            shared = 3 * h * m.moe_ffn_hidden_size * m.num_shared_experts
            experts = m.num_experts * 3 * h * m.moe_ffn_hidden_size
            self.dense += (mla + norms + shared + m.num_experts * h) / tp
            self.dense_muon += (mla + shared) / tp
            self.expert += experts / ep_etp
            self.expert_muon += experts / ep_etp
        else:
            ffn = 3 * h * m.ffn_hidden_size
            self.dense += (mla + norms + ffn) / tp
            self.dense_muon += (mla + ffn) / tp


def _ns_flops(rows: int, cols: int, steps: int) -> float:
    """Newton-Schulz on one [rows, cols] matrix: per quintic iteration on X (a x b, a <= b)
    A = X X^T (2 a^2 b), A A (2 a^3), (bA + cA^2) X (2 a^2 b)."""
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4.0 * a * a * b + 2.0 * a ** 3)


def _muon_layer(m, moe: bool, split: str, steps: int) -> tuple[list, list, float]:
    """Newton-Schulz FLOPs of one layer's Muon matrices as this project orthogonalises them
    (:mod:`pretrain.optim.matrices`): (whole matrices, TP-gathered; per-head blocks, every head
    of the layer; one routed expert's matrices), for what the DSA mode trains."""
    h, n = m.hidden_size, m.num_attention_heads
    nope, rope, v, ql, kl = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.q_lora_rank, m.kv_lora_rank
    whole, blocks, expert = [], [], 0.0
    mode = m.dsa.mode
    if mode in ("warmup", "sparse"):
        d = m.dsa
        whole += [_ns_flops(d.index_heads * d.index_head_dim, ql, steps),
                  _ns_flops(d.index_head_dim, h, steps), _ns_flops(d.index_heads, h, steps)]
    if mode == "warmup":
        return whole, blocks, expert
    whole += [_ns_flops(ql, h, steps), _ns_flops(kl + rope, h, steps), _ns_flops(h, n * v, steps)]
    if split == "per_head":
        blocks += [n * _ns_flops(nope + rope, ql, steps), n * (_ns_flops(nope, kl, steps) + _ns_flops(v, kl, steps))]
    else:
        whole += [_ns_flops(n * (nope + rope), ql, steps), _ns_flops(n * (nope + v), kl, steps)]
    if moe:
        shared = m.num_shared_experts * m.moe_ffn_hidden_size
        if shared:
            whole += [_ns_flops(2 * shared, h, steps), _ns_flops(h, shared, steps)]
        expert = _ns_flops(2 * m.moe_ffn_hidden_size, h, steps) + _ns_flops(h, m.moe_ffn_hidden_size, steps)
    else:
        whole += [_ns_flops(2 * m.ffn_hidden_size, h, steps), _ns_flops(h, m.ffn_hidden_size, steps)]
    return whole, blocks, expert


def step_time(rc, layout, cluster) -> StepTime:
    """Estimated step time of ``rc`` (one stage's resolved run config) laid out as ``layout``
    (:class:`parallel.config.Layout` at ``cluster.world_size``) on ``cluster``."""
    from model_providers.glm5.counting.flops import flops_per_token, megatron_flops_per_token

    m, p, t = rc.model, rc.parallel, rc.trainer
    L, mbs, world = t.seq_length, t.micro_batch_size, layout.world_size
    pp, vpp, tp, cp, ep, etp = p.pp, p.vpp or 1, p.tp, p.cp, p.ep, p.expert_tp
    micro = t.global_batch_size // (mbs * layout.dp)
    if micro < 1 or t.global_batch_size % (mbs * layout.dp):
        raise ValueError(f"trainer.global_batch_size={t.global_batch_size} is not a multiple of "
                         f"trainer.micro_batch_size={mbs} x data-parallel size {layout.dp}")
    c = cluster
    fp32 = rc.precision.dtype == "fp32"
    a = 4 if fp32 else 2  # bytes of an activation value
    dense_peak = c.tf32_tflops if fp32 else c.bf16_tflops
    head_rate = dense_peak * c.matmul_efficiency
    fp8 = rc.precision.fp8
    gemm_rate = c.fp8_tflops * c.fp8_matmul_efficiency * FP8_RECIPE_RATE[fp8] if fp8 else head_rate
    hbm = c.hbm_gbps * GB * c.hbm_efficiency
    model = _Model(rc)
    # the DSA warm-up runs the frozen network without autograd (dsa.modes.indexer_only_forward):
    # its layers run forward only, nothing is recomputed, backward is the indexers' alone
    frozen = m.dsa.mode == "warmup"
    backward = 0 if frozen else 1  # passes of the layers' backward (collectives, element-wise)
    modes = set() if frozen else {"full"} if m.recompute == "full" else set(m.recompute_modules if m.recompute else ())
    again_all = "full" in modes
    moe_again = again_all or "moe" in modes
    sparse_dsa = m.dsa.mode in ("warmup", "sparse")
    imb = c.moe_imbalance

    local_tokens = mbs * L / (tp * cp)  # the tokens' share of one GPU's work
    h = m.hidden_size
    act = mbs * (L / cp) * h * a  # one layer's hidden states on a TP group (full sequence share)
    routed_flops = 6 * h * m.moe_ffn_hidden_size * m.moe_topk * (  # forward, dgrad, wgrad, again
        1 + 2 * backward + moe_again) if m.num_experts else 0.0

    def compute(w, rate: float, moe: bool) -> float:
        split = (w.gemm / rate + w.attention / (dense_peak * c.attention_efficiency)
                 + w.indexer / (dense_peak * c.indexer_efficiency))
        whole = w.replicated / (dense_peak * c.indexer_efficiency)  # on every TP rank
        extra = (imb - 1) * routed_flops / rate if moe else 0.0  # the busiest expert rank's surplus
        return 1e-12 * local_tokens * (split + tp * whole + extra)

    def passes(name: str, again: bool) -> float:
        unfused, fused, switch = ELEMENTWISE[name]
        share = FORWARD_SHARE if frozen else 1 + FORWARD_SHARE * again
        return (fused if switch and getattr(p, switch) else unfused) * share

    def elementwise(moe: bool) -> float:
        """HBM bytes of one layer's element-wise work on one GPU per micro-batch."""
        qk = m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        values = ((2 * h + m.q_lora_rank + m.kv_lora_rank) * passes("norms", again_all or "layernorm" in modes)
                  + 2 * h * passes("residual", again_all)
                  + 2 * qk * passes("rope", again_all or "mla_up_proj" in modes))
        n = m.num_attention_heads
        cast = (2 * h + m.q_lora_rank + m.kv_lora_rank + n * m.v_head_dim  # inputs
                + m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim + qk
                + n * (m.qk_nope_head_dim + m.v_head_dim) + h)  # output gradients
        if moe:
            shared = m.num_shared_experts * m.moe_ffn_hidden_size
            routed = imb * m.moe_topk * m.moe_ffn_hidden_size
            values += (routed * passes("swiglu", moe_again or "moe_act" in modes)
                       + shared * passes("swiglu", moe_again or "shared_experts" in modes)
                       + imb * m.moe_topk * h * passes("permute", moe_again))
            cast += imb * m.moe_topk * 2 * h + 3 * routed + (2 * h + 3 * shared if shared else 0)
            fp8_bytes = FP8_CAST_BYTES * cast * (1 + FORWARD_SHARE * moe_again) if fp8 else 0.0
            return local_tokens * (a * values + FP32 * m.num_experts * passes("router", moe_again) + fp8_bytes)
        values += m.ffn_hidden_size * passes("swiglu", again_all or "mlp" in modes)
        cast += 2 * h + 3 * m.ffn_hidden_size
        fp8_bytes = FP8_CAST_BYTES * cast * (1 + FORWARD_SHARE * again_all) if fp8 else 0.0
        return local_tokens * (a * values + fp8_bytes)

    def launches(moe: bool) -> float:
        return c.launch_gap_us * 1e-6 * (2 if again_all or (moe and moe_again) else 1)

    def tp_layer(moe: bool) -> float:
        if tp == 1:
            return 0.0
        collectives = 2 + (0 if moe and etp == 1 else 2)  # per forward: around attention, around FFN
        one = _group_time(act, tp, 1, c, c.comm_efficiency)
        return collectives * one * ((2 if again_all else 1) + backward)

    def ep_layer() -> float:
        if ep == 1:
            return 0.0
        tokens = mbs * L / (cp * tp)
        if p.moe_token_dispatcher_type == "flex":
            one = _flex_time(tokens, h * a, m, ep, etp, c)
        else:
            one = _alltoall_time(tokens * m.moe_topk * h * a, ep, etp, c)
        passes_ = 1 + backward + (1 if moe_again else 0)  # forward, backward, recomputed forward
        return 2 * passes_ * one * imb  # dispatch and combine

    def cp_layer() -> float:
        if cp == 1:
            return 0.0
        per_token = m.kv_lora_rank + m.qk_rope_head_dim + (m.dsa.index_head_dim if sparse_dsa else 0)
        one = _group_time(mbs * L * per_token * a, cp, tp, c, c.comm_efficiency)
        return one * ((2 if again_all else 1) + backward)

    grads = _rank_grads(rc, layout)
    mtp_steps = m.mtp_num_steps
    last = m.num_layers - 1
    mtp_moe = model.is_moe(last)
    mtp_rank, loss_rank = _piece_rank(layout, pp, "mtp"), _piece_rank(layout, pp, "loss")
    vocab = m.padded_vocab_size(tp)
    rows = []
    for r, layers in enumerate(_rank_layers(layout, pp)):
        cmp = sum(compute(model.work(i), gemm_rate, model.is_moe(i)) for i in layers)
        hbm_bytes = sum(elementwise(model.is_moe(i)) for i in layers)
        gaps = sum(launches(model.is_moe(i)) for i in layers)
        tps = sum(tp_layer(model.is_moe(i)) for i in layers)
        eps = sum(ep_layer() for i in layers if model.is_moe(i))
        cps = cp_layer() * len(layers)
        if r == mtp_rank and mtp_steps:
            cmp += compute(model.mtp, gemm_rate, False)
            if mtp_moe and imb > 1:
                cmp += mtp_steps * 1e-12 * local_tokens * (imb - 1) * routed_flops / gemm_rate
            hbm_bytes += mtp_steps * elementwise(mtp_moe)
            gaps += mtp_steps * launches(mtp_moe)
            tps += mtp_steps * (tp_layer(mtp_moe) + 2 * (_group_time(act, tp, 1, c, c.comm_efficiency) if tp > 1 else 0.0))
            eps += mtp_steps * (ep_layer() if mtp_moe else 0.0)
            cps += mtp_steps * cp_layer()
        if r == loss_rank:
            cmp += compute(model.heads, head_rate, False)
            hbm_bytes += (1 + mtp_steps) * local_tokens * vocab * FP32 * passes("cross_entropy", False)
            tps += (1 + mtp_steps) * (1 + backward) * (_group_time(act, tp, 1, c, c.comm_efficiency) if tp > 1 else 0.0)
        if not p.gradient_accumulation_fusion and m.dsa.mode != "warmup":
            hbm_bytes += (grads[r].dense + grads[r].expert) * GRAD_ACCUMULATION_BYTES
        rows.append(dict(compute=cmp, elementwise=hbm_bytes / hbm, launch=gaps, tp=tps, ep=eps, cp=cps))

    hidden_mb = []
    for r, row in enumerate(rows):
        work = row["compute"] + row["elementwise"]
        tp_hidden = row["tp"] * c.tp_overlap if p.tp_comm_overlap else 0.0
        ep_hidden = 0.0
        if p.overlap_moe_expert_parallel_comm:
            ep_hidden = min(row["ep"] * c.ep_overlap * _steady_share(pp, vpp, r, micro), work)
        cp_hidden = row["cp"] * c.cp_overlap
        row.update(tp=row["tp"] - tp_hidden, ep=row["ep"] - ep_hidden, cp=row["cp"] - cp_hidden)
        hidden_mb.append(tp_hidden + ep_hidden + cp_hidden)
    p2p = 0.0
    if pp > 1:
        sent = act / (tp if p.sequence_parallel else 1)
        stride = world // pp
        bw = c.nvlink_gbps if stride < c.gpus_per_node else c.internode_gbps
        p2p = 2 * vpp * sent / (bw * GB * c.comm_efficiency) * (1 - c.pp_overlap)
    slow = max(range(pp), key=lambda r: sum(rows[r].values()))
    row = {k: v * micro for k, v in rows[slow].items()}
    p2ps = p2p * micro
    busy = sum(row.values()) + p2ps
    bubble = (pp - 1) / (vpp * micro) * busy
    per_mb = rows[slow]["compute"] + rows[slow]["elementwise"]
    reduce, gather, other = _dp_time(rc, layout, c, a, grads)
    dp_hidden = 0.0
    if p.overlap_grad_reduce:  # behind the last micro-batch's backward and the cool-down
        dp_hidden += min(reduce * c.dp_overlap, (1 - FORWARD_SHARE) * per_mb + bubble / 2)
    if p.overlap_param_gather:  # behind the first micro-batch's forward and the warm-up
        dp_hidden += min(gather * c.dp_overlap, FORWARD_SHARE * per_mb + bubble / 2)
    dp = reduce + gather + other - dp_hidden
    opt = _optimizer_time(rc, layout, c, grads)
    total = busy + bubble + dp + opt
    tokens_per_s = t.global_batch_size * L / total / world
    peak = c.bf16_tflops * 1e12
    mfu = megatron_flops_per_token(m, L, tp) * tokens_per_s / peak
    exact = flops_per_token(m, L, tp, cp).total * tokens_per_s / peak
    return StepTime(compute_s=row["compute"], tp_s=row["tp"], ep_s=row["ep"], pp_bubble_s=bubble,
                    cp_s=row["cp"], dp_s=dp, total_s=total, tokens_per_s_per_gpu=tokens_per_s, mfu=mfu,
                    assumptions=_assumptions(rc, c, gemm_rate, head_rate, dense_peak),
                    mfu_exact=exact, pp_p2p_s=p2ps, micro_batches=micro, slowest_rank=slow,
                    elementwise_s=row["elementwise"], launch_s=row["launch"], optimizer_s=opt,
                    hidden_s=hidden_mb[slow] * micro + dp_hidden)


def _steady_share(pp: int, vpp: int, rank: int, micro: int) -> float:
    """Share of a pipeline rank's (micro-batch, chunk) forwards that megatron's schedule pairs
    with another micro-batch's backward (the 1F1B steady state; without a pipeline every forward
    but the first)."""
    total = micro * vpp
    if pp == 1:
        warmup = 1
    elif vpp == 1:
        warmup = pp - rank - 1
    else:
        warmup = 2 * (pp - rank - 1) + (vpp - 1) * pp
    return max(0.0, 1.0 - min(warmup, total) / total)


def _rank_grads(rc, layout) -> list:
    """The trained parameters of each pipeline rank, per GPU (:class:`_Grads`): its layers, the
    MTP layer and eh_proj on the MTP rank, the word embedding on the first rank and the output
    layer and MTP's embedding copy on the loss / MTP ranks (the DSA mode decides what trains)."""
    m, p = rc.model, rc.parallel
    tp, ep, etp, pp = p.tp, p.ep, p.expert_tp, p.pp
    vocab_h = m.padded_vocab_size(tp) * m.hidden_size / tp
    trains_main = m.dsa.mode != "warmup"
    ranks = {piece: _piece_rank(layout, pp, piece) for piece in ("embedding", "mtp", "loss")}

    def moe_at(i: int) -> bool:
        return bool(m.num_experts) and i >= m.first_k_dense

    out = []
    for r, layers in enumerate(_rank_layers(layout, pp)):
        g = _Grads()
        for i in layers:
            g.add_layer(m, moe_at(i), tp, ep * etp)
        if r == ranks["mtp"] and m.mtp_num_steps:
            g.add_layer(m, moe_at(m.num_layers - 1), tp, ep * etp)
        if trains_main:
            copies = (r == ranks["embedding"]) + (r == ranks["loss"]) + bool(r == ranks["mtp"] and m.mtp_num_steps)
            g.dense += vocab_h * copies
            if r == ranks["mtp"] and m.mtp_num_steps:
                g.dense += 2 * m.hidden_size ** 2 / tp
                g.dense_muon += 2 * m.hidden_size ** 2 / tp
        out.append(g)
    return out


def _dp_time(rc, layout, cluster, param_bytes: int, grads: list) -> tuple[float, float, float]:
    """(gradient reduction, parameter gathering, the rest) over data parallelism after the last
    micro-batch, for the pipeline rank with the most to move: the distributed optimizer's fp32
    gradient reduce-scatter and parameter all-gather (otherwise an fp32 all-reduce, counted as the
    reduction); the rest: Muon's fp32 all-gather of its matrices (distributed optimizer) and the
    all-reduce of the word embedding's gradient between its copies (first stage, MTP)."""
    m, p = rc.model, rc.parallel
    tp, cp, ep, etp, pp = p.tp, p.cp, p.ep, p.expert_tp, p.pp
    dense_group, expert_group = layout.dp * cp, layout.expert_dp
    muon = rc.optimizer.name.startswith("muon") and p.distributed_optimizer
    worst, worst_sum = (0.0, 0.0, 0.0), -1.0
    for g in grads:
        reduce = gather = other = 0.0
        for n, muon_n, group, stride in ((g.dense, g.dense_muon, dense_group, tp),
                                         (g.expert, g.expert_muon, expert_group, ep * etp)):
            if p.distributed_optimizer:
                reduce += _group_time(n * 4, group, stride, cluster, cluster.comm_efficiency)
                gather += _group_time(n * param_bytes, group, stride, cluster, cluster.comm_efficiency)
                other += _group_time(4 * muon_n, group, stride, cluster, cluster.comm_efficiency) if muon else 0.0
            else:
                reduce += _group_time(2 * 4 * n, group, stride, cluster, cluster.comm_efficiency)
        if reduce + gather + other > worst_sum:
            worst, worst_sum = (reduce, gather, other), reduce + gather + other
    reduce, gather, other = worst
    emb, mtp = _piece_rank(layout, pp, "embedding"), _piece_rank(layout, pp, "mtp")
    if m.mtp_num_steps and m.dsa.mode != "warmup" and emb != mtp:
        vocab_h = m.padded_vocab_size(tp) * m.hidden_size / tp
        other += _group_time(2 * 4 * vocab_h, 2, layout.world_size // pp * abs(mtp - emb), cluster,
                             cluster.comm_efficiency)
    return reduce, gather, other


def _optimizer_time(rc, layout, cluster, grads: list) -> float:
    """The optimizer step of the rank with the most work: element-wise traffic of the elements it
    steps (``OPTIMIZER_BYTES``; bf16 Adam moments save 4 bytes each; Muon's assembly buffer) and
    Muon's Newton-Schulz on the matrices it owns a part of (whole TP-gathered matrices and
    per-head blocks over the dense DP x CP group, routed experts over the expert-DP group; at
    least the largest one), at the fp32 CUDA-core peak (``ns_dtype: fp32``: torch's default
    fp32 matmul, no TF32) or the bf16 peak, times ``matmul_efficiency``."""
    m, p, opt = rc.model, rc.parallel, rc.optimizer
    c = cluster
    distributed = p.distributed_optimizer
    dense_group = layout.dp * p.cp if distributed else 1
    expert_group = layout.expert_dp if distributed else 1
    muon = opt.name.startswith("muon")
    moments = sum(4 if getattr(opt, f, "fp32") == "bf16" else 0 for f in ("exp_avg_dtype", "exp_avg_sq_dtype"))
    hbm = c.hbm_gbps * GB * c.hbm_efficiency
    steps = opt.muon.ns_steps if muon else 0
    split = opt.muon.split if muon else "none"
    rate = 1e12 * c.matmul_efficiency * (c.fp32_tflops if opt.muon.ns_dtype == "fp32" else c.bf16_tflops)
    mtp_rank = _piece_rank(layout, p.pp, "mtp")
    worst = 0.0
    for r, (g, layers) in enumerate(zip(grads, _rank_layers(layout, p.pp))):
        owned = g.dense / dense_group + g.expert / expert_group
        owned_muon = (g.dense_muon / dense_group + g.expert_muon / expert_group) if muon else 0.0
        traffic = (owned - owned_muon) * (OPTIMIZER_BYTES - moments) + owned_muon * (OPTIMIZER_BYTES - 8)
        if muon and distributed:
            traffic += (g.dense_muon + g.expert_muon) * MUON_ASSEMBLY_BYTES
        seconds = traffic / hbm
        if muon:
            kinds = [bool(m.num_experts) and i >= m.first_k_dense for i in layers]
            if r == mtp_rank and m.mtp_num_steps:
                kinds.append(bool(m.num_experts) and m.num_layers - 1 >= m.first_k_dense)
            dense, largest, expert = 0.0, 0.0, 0.0
            for moe in kinds:
                whole, blocks, one_expert = _muon_layer(m, moe, split, steps)
                dense += sum(whole) + sum(blocks) / p.tp
                largest = max([largest, *whole])
                expert += one_expert * (m.num_experts or 0) / p.ep
            if r == mtp_rank and m.mtp_num_steps and m.dsa.mode != "warmup":
                e = _ns_flops(m.hidden_size, 2 * m.hidden_size, steps)
                dense, largest = dense + e, max(largest, e)
            flops = max(dense / dense_group, largest if dense else 0.0) + max(
                expert / expert_group, expert / max(1, (m.num_experts or 1) // p.ep * len(kinds)) if expert else 0.0)
            seconds += flops / rate
        worst = max(worst, seconds)
    return worst


def _assumptions(rc, cluster, gemm_rate: float, head_rate: float, dense_peak: float) -> dict:
    c, p = cluster, rc.parallel
    fp8 = rc.precision.fp8
    kind = "tf32" if rc.precision.dtype == "fp32" else "bf16"
    on = lambda flag: "on" if getattr(p, flag) else "off"  # noqa: E731
    linear = (f"{c.fp8_matmul_efficiency:.0%} of {c.fp8_tflops:g} fp8 TFLOP/s x {FP8_RECIPE_RATE[fp8]:.3f} "
              f"({fp8}) = {gemm_rate:.0f}; output heads {head_rate:.0f} {kind}" if fp8 else
              f"{c.matmul_efficiency:.0%} of {dense_peak:g} {kind} TFLOP/s = {gemm_rate:.0f}")
    fusions = ", ".join(f"{name} {passes:g}" + ("" if sw is None else f" ({'fused' if getattr(p, sw) else 'unfused'})")
                        for name, (u, f, sw) in ELEMENTWISE.items()
                        for passes in [f if sw and getattr(p, sw) else u])
    fusions += f"; FP8 casts {FP8_CAST_BYTES} B per linear input / output-gradient value" if fp8 else ""
    dispatcher = ("flex (one network copy per destination node, NVLink forwarding inside it) at "
                  f"{c.flex_rdma_efficiency:.0%} of network / {c.flex_nvlink_efficiency:.0%} of NVLink"
                  if p.moe_token_dispatcher_type == "flex" else
                  f"alltoall (one copy per routed expert) at {c.alltoall_efficiency:.0%} of link bandwidth")
    return {
        "linear layers": linear,
        "attention core": f"{c.attention_efficiency:.0%} of {dense_peak:g} TFLOP/s",
        "DSA indexer": f"{c.indexer_efficiency:.0%} of {dense_peak:g} TFLOP/s",
        "element-wise": f"HBM passes per token ({fusions}); gradient accumulation "
                        f"{'fused' if p.gradient_accumulation_fusion else f'+{GRAD_ACCUMULATION_BYTES} B/param/micro-batch'}; "
                        f"at {c.hbm_efficiency:.0%} of {c.hbm_gbps:g} GB/s",
        "launch gaps": f"{c.launch_gap_us:g} us per layer forward",
        "expert imbalance": f"busiest expert rank x{c.moe_imbalance:g} of the mean (routed GEMMs, permutes, all-to-all)",
        "collectives": f"{c.comm_efficiency:.0%} of NVLink {c.nvlink_gbps:g} / network "
                       f"{c.internode_gbps:g} GB/s per GPU (ring; multi-node groups use every NIC)",
        "EP dispatcher": dispatcher,
        "overlap": f"TP {c.tp_overlap:.0%} if tp_comm_overlap ({on('tp_comm_overlap')}); EP {c.ep_overlap:.0%} "
                   f"of the steady 1F1B phase if overlap_moe_expert_parallel_comm ({on('overlap_moe_expert_parallel_comm')}); "
                   f"DP {c.dp_overlap:.0%} within the last/first micro-batch + half the bubble if "
                   f"overlap_grad_reduce ({on('overlap_grad_reduce')}) / overlap_param_gather "
                   f"({on('overlap_param_gather')}); CP {c.cp_overlap:.0%}, PP sends {c.pp_overlap:.0%}",
        "pipeline bubble": "(pp - 1) / (vpp x micro-batches) of the slowest rank's busy time",
        "recompute": "the stage's recomputed forwards (model.recompute) and their collectives counted",
        "optimizer step": f"{OPTIMIZER_BYTES} B per stepped element (bf16 moments -4 B each); Muon: "
                          "Newton-Schulz on owned matrices at the fp32 (ns_dtype fp32) or bf16 peak x matmul efficiency",
        "MFU": "Megatron-LM's FLOPs accounting over the bf16 dense peak (mfu_exact: the exact count)",
        "not modelled": "stragglers, Muon's TP gather of split matrices, host-side optimizer work",
    }
