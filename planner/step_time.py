"""Estimated time of one training step of a stage on a cluster: compute + exposed communication.

Per micro-batch, each pipeline rank computes its decoder layers (and, on the last rank, the MTP
module and the output heads) on its share of the tokens -- TP and CP split every layer's work
but the lightning indexer's, which each TP rank repeats; EP spreads the routed experts' -- at
the cluster's peak times an efficiency per kind of work
(:func:`model_providers.glm5.counting.flops.layer_work`, recomputed forwards included), and spends time in
the collectives its layers issue:

- TP (tp > 1): per layer, forward all-gather + reduce-scatter of the activations around attention
  and around the dense FFN (MoE layers with expert TP 1 need none: the dispatcher moves tokens),
  the same in backward, again for recomputed forwards; the output heads gather the hidden states.
- EP (ep > 1): per MoE layer, the token all-to-all dispatch and combine (one copy per routed
  expert, bf16 hidden), forward and backward, again when the MoE forward is recomputed; the
  share of peers on other nodes goes over the network, the rest over NVLink.
- CP (cp > 1): per attention layer, the all-gather of the kv latent (kv_lora_rank + rope values
  per token) and of the indexer keys (DSA warm-up / sparse), reduce-scattered back in backward.
- PP: point-to-point sends of the activations and their gradients between stages.

The slowest pipeline rank sets the pace: compute + exposed communication per micro-batch, times
the micro-batches of a step; the pipeline bubble adds ``(pp - 1) / (vpp * m)`` of that. After the
last micro-batch the data-parallel gradient reduction (distributed optimizer: fp32 gradient
reduce-scatter + parameter all-gather; otherwise an fp32 all-reduce; Muon with the distributed
optimizer adds its fp32 all-reduce of the Muon matrices) and the first/last-stage all-reduce of
the embedding MTP shares. A collective over ranks on several nodes runs at the nodes' aggregate
network bandwidth (each GPU has its own NIC); one inside a node at NVLink bandwidth.

Not modelled: Muon's Newton-Schulz compute, the optimizer's element-wise work, expert load
imbalance, kernel launch gaps, stragglers. ``StepTime.assumptions`` lists what is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step, by what the slowest pipeline rank waits for (exposed time only)."""

    compute_s: float
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


def _rank_layers(layout, pp: int) -> list[list[int]]:
    """Decoder layer indices (0-based) of each pipeline rank; chunk c of the model order belongs
    to rank c % pp."""
    ranks = [[] for _ in range(pp)]
    start = 0
    for c, n in enumerate(layout.layers_per_stage):
        ranks[c % pp].extend(range(start, start + n))
        start += n
    return ranks


class _Model:
    """Per-layer work and parameter counts of one stage's model, each kind computed once."""

    def __init__(self, rc):
        from model_providers.glm5.counting.flops import layer_work, post_work

        m, L, tp, cp = rc.model, rc.trainer.seq_length, rc.parallel.tp, rc.parallel.cp
        self.m = m
        self._work = {}
        for i in range(m.num_layers):
            key = self.kind(i)
            if key not in self._work:
                self._work[key] = layer_work(m, L, i, tp, cp)
        self.post = post_work(m, L, tp, cp)

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
    fp32 = rc.precision.dtype == "fp32"
    act_bytes = 4 if fp32 else 2
    dense_peak = cluster.tf32_tflops if fp32 else cluster.bf16_tflops
    gemm_peak = cluster.fp8_tflops if rc.precision.fp8 else dense_peak
    gemm_eff = cluster.fp8_matmul_efficiency if rc.precision.fp8 else cluster.matmul_efficiency
    model = _Model(rc)
    modes = {"full"} if m.recompute == "full" else set(m.recompute_modules if m.recompute else ())
    again_all = "full" in modes
    sparse_dsa = m.dsa.mode in ("warmup", "sparse")

    local_tokens = mbs * L / (tp * cp)  # the tokens' share of one GPU's work
    h = m.hidden_size
    act = mbs * (L / cp) * h * act_bytes  # one layer's hidden states on a TP group (full sequence share)

    def compute(w) -> float:
        split = (w.gemm / (gemm_peak * gemm_eff) + w.attention / (dense_peak * cluster.attention_efficiency)
                 + w.indexer / (dense_peak * cluster.indexer_efficiency))
        whole = w.replicated / (dense_peak * cluster.indexer_efficiency)  # on every TP rank
        return 1e-12 * (local_tokens * split + local_tokens * tp * whole)

    fwd_passes = 2 if again_all else 1

    def tp_layer(moe: bool) -> float:
        if tp == 1:
            return 0.0
        collectives = 2 + (0 if moe and etp == 1 else 2)  # per forward: around attention, around FFN
        one = _group_time(act, tp, 1, cluster, cluster.comm_efficiency)
        return collectives * one * (fwd_passes + 1)

    def ep_layer() -> float:
        if ep == 1:
            return 0.0
        sent = mbs * L / (cp * tp) * m.moe_topk * h * act_bytes
        passes = 2 + (1 if again_all or "moe" in modes else 0)  # forward, backward, recomputed forward
        return 2 * passes * _alltoall_time(sent, ep, etp, cluster)

    def cp_layer() -> float:
        if cp == 1:
            return 0.0
        per_token = m.kv_lora_rank + m.qk_rope_head_dim + (m.dsa.index_head_dim if sparse_dsa else 0)
        one = _group_time(mbs * L * per_token * act_bytes, cp, tp, cluster, cluster.comm_efficiency)
        return one * (fwd_passes + 1)

    mtp_steps = m.mtp_num_steps
    mtp_moe = bool(m.num_experts) and m.num_layers > m.first_k_dense
    per_rank = []
    for r, layers in enumerate(_rank_layers(layout, pp)):
        c = sum(compute(model.work(i)) for i in layers)
        tps = sum(tp_layer(model.is_moe(i)) for i in layers)
        eps = sum(ep_layer() for i in layers if model.is_moe(i))
        cps = cp_layer() * len(layers)
        if r == pp - 1:
            c += compute(model.post)
            tps += mtp_steps * tp_layer(mtp_moe) + (1 + mtp_steps) * 2 * (
                _group_time(act, tp, 1, cluster, cluster.comm_efficiency) if tp > 1 else 0.0)
            eps += mtp_steps * (ep_layer() if mtp_moe else 0.0)
            cps += mtp_steps * cp_layer()
        per_rank.append((c, tps * (1 - cluster.tp_overlap), eps * (1 - cluster.ep_overlap),
                         cps * (1 - cluster.cp_overlap)))
    p2p = 0.0
    if pp > 1:
        sent = act / (tp if p.sequence_parallel else 1)
        stride = world // pp
        bw = cluster.nvlink_gbps if stride < cluster.gpus_per_node else cluster.internode_gbps
        p2p = 2 * vpp * sent / (bw * GB * cluster.comm_efficiency) * (1 - cluster.pp_overlap)
    slow = max(range(pp), key=lambda r: sum(per_rank[r]))
    c, tps, eps, cps = (x * micro for x in per_rank[slow])
    p2ps = p2p * micro
    busy = c + tps + eps + cps + p2ps
    bubble = (pp - 1) / (vpp * micro) * busy
    dp = _dp_time(rc, layout, cluster, act_bytes) * (1 - cluster.dp_overlap)
    total = busy + bubble + dp
    tokens_per_s = t.global_batch_size * L / total / world
    peak = cluster.bf16_tflops * 1e12
    mfu = megatron_flops_per_token(m, L, tp) * tokens_per_s / peak
    exact = flops_per_token(m, L, tp, cp).total * tokens_per_s / peak
    return StepTime(compute_s=c, tp_s=tps, ep_s=eps, pp_bubble_s=bubble, cp_s=cps, dp_s=dp,
                    total_s=total, tokens_per_s_per_gpu=tokens_per_s, mfu=mfu,
                    assumptions=_assumptions(rc, cluster, gemm_peak, gemm_eff, dense_peak),
                    mfu_exact=exact, pp_p2p_s=p2ps, micro_batches=micro, slowest_rank=slow)


def _dp_time(rc, layout, cluster, param_bytes: int) -> float:
    """Gradient reduction and parameter gathering over data parallelism after the last
    micro-batch, for the pipeline rank with the most trained parameters (the DSA mode decides
    which train); plus the first/last-stage all-reduce of the word embedding's gradient (MTP's
    copy on the last stage)."""
    m, p = rc.model, rc.parallel
    tp, cp, ep, etp, pp = p.tp, p.cp, p.ep, p.expert_tp, p.pp
    dense_group, expert_group = layout.dp * cp, layout.expert_dp
    muon = rc.optimizer.name.startswith("muon") and p.distributed_optimizer
    vocab_h = m.padded_vocab_size(tp) * m.hidden_size / tp
    trains_main = m.dsa.mode != "warmup"

    def moe_at(i: int) -> bool:
        return bool(m.num_experts) and i >= m.first_k_dense

    worst = 0.0
    for r, layers in enumerate(_rank_layers(layout, pp)):
        g = _Grads()
        for i in layers:
            g.add_layer(m, moe_at(i), tp, ep * etp)
        if r == pp - 1 and m.mtp_num_steps:
            g.add_layer(m, moe_at(m.num_layers - 1), tp, ep * etp)
        if trains_main:
            # embedding (first), output layer and MTP's embedding copy (last), MTP's eh_proj
            g.dense += vocab_h * ((r == 0) + (r == pp - 1) * (2 if m.mtp_num_steps else 1))
            if r == pp - 1 and m.mtp_num_steps:
                g.dense += 2 * m.hidden_size ** 2 / tp
                g.dense_muon += 2 * m.hidden_size ** 2 / tp
        seconds = 0.0
        for n, muon_n, group, stride in ((g.dense, g.dense_muon, dense_group, tp),
                                         (g.expert, g.expert_muon, expert_group, ep * etp)):
            if p.distributed_optimizer:
                volume = n * (4 + param_bytes) + (2 * 4 * muon_n if muon else 0)  # RS fp32 + AG params
            else:
                volume = 2 * 4 * n  # all-reduce of fp32 grads
            seconds += _group_time(volume, group, stride, cluster, cluster.comm_efficiency)
        worst = max(worst, seconds)
    if pp > 1 and m.mtp_num_steps and trains_main:
        worst += _group_time(2 * 4 * vocab_h, 2, layout.world_size // pp * (pp - 1), cluster,
                             cluster.comm_efficiency)
    return worst


def _assumptions(rc, cluster, gemm_peak: float, gemm_eff: float, dense_peak: float) -> dict:
    c = cluster
    kind = "fp8" if rc.precision.fp8 else ("tf32" if rc.precision.dtype == "fp32" else "bf16")
    return {
        "linear layers": f"{gemm_eff:.0%} of {gemm_peak:g} {kind} TFLOP/s",
        "attention core": f"{c.attention_efficiency:.0%} of {dense_peak:g} TFLOP/s",
        "DSA indexer": f"{c.indexer_efficiency:.0%} of {dense_peak:g} TFLOP/s",
        "collectives": f"{c.comm_efficiency:.0%} of NVLink {c.nvlink_gbps:g} / network "
                       f"{c.internode_gbps:g} GB/s per GPU (ring; multi-node groups use every NIC)",
        "EP all-to-all": f"{c.alltoall_efficiency:.0%} of link bandwidth, one copy per routed expert",
        "overlap": f"TP {c.tp_overlap:.0%}, EP {c.ep_overlap:.0%}, CP {c.cp_overlap:.0%}, "
                   f"DP {c.dp_overlap:.0%}, PP sends {c.pp_overlap:.0%} hidden",
        "pipeline bubble": "(pp - 1) / (vpp x micro-batches) of the slowest rank's busy time",
        "recompute": "the stage's recomputed forwards (model.recompute) and their collectives counted",
        "MFU": "Megatron-LM's FLOPs accounting over the bf16 dense peak (mfu_exact: the exact count)",
        "not modelled": "Muon Newton-Schulz compute, optimizer element-wise work, expert load "
                        "imbalance, launch gaps",
    }
