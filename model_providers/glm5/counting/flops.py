"""Training FLOPs per token of GLM-5, in two conventions.

:func:`flops_per_token` counts the matrix products this project runs for one training step of a
sequence of ``seq_length`` tokens, divided by the tokens:

- every linear layer: forward, and in backward the input gradient and, for trainable weights,
  the weight gradient (2 m n k each); routed experts per token ``moe_topk``, plus the shared
  expert and the router;
- the attention core as flash kernels do it: forward ``S = QK^T``, ``O = PV`` over exactly the
  keys each query sees (causal: row t sees t + 1 keys), backward recomputes ``S`` and forms
  ``dP, dV, dQ, dK`` (2.5x the forward: torch's FlopCounterMode's SDPA formula);
- ``dsa.mode=sparse``: queries at positions < topk attend densely (they see fewer than topk
  keys); every later one attends to topk keys through the absorbed (MQA) form of MLA
  (``q W_UK``, scores over kv_lora_rank + rope dims, ``P C``, ``O W_UV``), while megatron's MLA
  still up-projects k and v for every token (only the dense prefix reads them);
- the lightning indexer (``warmup`` and ``sparse``): its projections (forward + weight gradient:
  its inputs are detached), top-k scoring of every visible key (sparse), and the KL: the dense
  target (the main heads' ``QK^T``) and the indexer scores with their gradients, which the KL
  computes in its forward (``dsa/kl.py``); every TP rank computes all of it but the target;
- ``warmup`` trains the indexer only, on inputs it reads detached: the frozen network runs
  without autograd (``dsa.modes.indexer_only_forward``), so it has no backward and nothing is
  recomputed; the backward is the indexer projections' weight gradients (the KL's own
  gradients are formed in its forward);
- MTP: ``mtp_num_steps`` applications of one layer (like the last decoder layer) and its
  ``eh_proj``; one output head for the main model and one per MTP step (padded vocabulary).

Context parallelism (``cp`` > 1) adds work: every CP rank up-projects the all-gathered kv latent of
the whole sequence (``dsa/attention.py``: cp more expansions per token, on top of megatron's own
local one, whose k/v are then unused), and dense attention runs the blocked path
(``dsa/dense_attention.py``: blocks of up to 1024 rows against every key up to their last row,
each block's forward recomputed in its backward). Packed documents also take the blocked path and
see fewer keys; this count assumes one document per sequence.

Recomputation (``model.recompute``) re-runs forwards in backward; that is
:attr:`FlopsPerToken.recompute`, outside ``total`` (``hardware`` adds it). Element-wise work
(norms, RoPE, softmax, top-k, losses) is not counted.

:func:`megatron_flops_per_token` is Megatron-LM's ``num_floating_point_operations``
(``megatron/training/training.py``) for this model: 3x every GEMM, MLA projections with their
norms, dense causal attention (``seq / 2`` keys per query, whatever the DSA mode), SwiGLU dense,
routed (top-k) and shared experts (no router), MTP layers counted as layers of the last layer's
kind plus their ``eh_proj`` and norms, and the logits of the main head and every MTP head. It is
the accounting published MFU numbers use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from model_providers.glm5.model.config import GLM5Config


@dataclass(frozen=True)
class FlopsPerToken:
    """Training (forward + backward) FLOPs per token, exact causal counts (see the module doc).

    ``dense``, ``attention`` and ``indexer`` are the decoder layers' (projections and FFN/MoE;
    attention core; lightning indexer), ``mtp`` the MTP module at all its steps (all its parts),
    ``output_heads`` the main and MTP output layers; ``total`` is their sum. ``recompute`` is the
    forward work activation recomputation adds on top; ``forward`` the forward part of
    ``total``."""

    dense: float
    attention: float
    indexer: float
    mtp: float
    output_heads: float
    total: float
    recompute: float = 0.0
    forward: float = 0.0

    @property
    def hardware(self) -> float:
        """What the GPUs execute: ``total`` plus recomputed forwards."""
        return self.total + self.recompute


@dataclass(frozen=True)
class _Work:
    """FLOPs of one part over a whole sequence: forward, backward and the forward re-run by
    activation recomputation."""

    fwd: float = 0.0
    bwd: float = 0.0
    again: float = 0.0

    def __add__(self, o: "_Work") -> "_Work":
        return _Work(self.fwd + o.fwd, self.bwd + o.bwd, self.again + o.again)

    def __mul__(self, k: float) -> "_Work":
        return _Work(self.fwd * k, self.bwd * k, self.again * k)

    __rmul__ = __mul__

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


def _triangle(a: int, b: int) -> int:
    """Keys seen by rows a..b-1 of a causal sequence (row t sees t + 1): sum of t + 1."""
    return (b * (b + 1) - a * (a + 1)) // 2 if b > a else 0


@functools.lru_cache(maxsize=256)
def _blocked_pairs(L: int, cp: int, limit: int) -> int:
    """(query, key) pairs the blocked dense attention computes for the queries at positions
    < ``limit`` of an L-token sequence split zigzag over ``cp`` ranks (rank r holds chunks r and
    2cp - 1 - r of L / 2cp positions; the middle rank's two are one run): blocks of at most
    BLOCK_ROWS rows of one run, each against keys 0 .. its last row; a block starting at
    position 0 is SDPA's causal square."""
    from model_providers.glm5.model.dsa.dense_attention import BLOCK_ROWS

    c = L // (2 * cp)
    runs = []
    for r in range(cp):
        first, second = r, 2 * cp - 1 - r
        runs += [(first * c, 2 * c)] if second == first + 1 else [(first * c, c), (second * c, c)]
    pairs = 0
    for start, length in runs:
        rows = min(length, limit - start)
        for b0 in range(0, rows, BLOCK_ROWS):
            b = min(BLOCK_ROWS, rows - b0)
            p0 = start + b0
            pairs += b * (b + 1) // 2 if p0 == 0 else b * (p0 + b)
    return pairs


def _linear(flops: float, trains: bool, dgrad: bool = True, again: bool = False) -> _Work:
    """A linear layer's forward ``flops``: backward is the input gradient (``dgrad``) plus the
    weight gradient (``trains``), each the forward's size."""
    return _Work(flops, flops * (int(dgrad) + int(trains)), flops if again else 0.0)


def _recomputes(m: GLM5Config) -> set:
    """Parts whose forward recomputation repeats: 'all' (full), or megatron's selective modules."""
    if m.recompute == "full":
        return {"all"}
    if m.recompute == "selective":
        return set(m.recompute_modules)
    return set()


class _Layer:
    """One transformer layer's work over a sequence of ``L`` tokens, by part."""

    def __init__(self, m: GLM5Config, L: int, moe: bool, tp: int = 1,
                 cp: int = 1):
        self.m, self.L, self.moe, self.tp, self.cp = m, L, moe, tp, cp
        self.mode = m.dsa.mode
        self.warmup = self.mode == "warmup"
        self.trains = not self.warmup  # the main model's weights
        # warm-up: the frozen network runs without autograd: no input gradients, no recomputation
        self.dgrad = self.pre_core_dgrad = not self.warmup
        self.again = set() if self.warmup else _recomputes(m)

    def _again(self, *names) -> bool:
        return "all" in self.again or bool(self.again & set(names))

    def projections(self) -> _Work:
        m, L = self.m, self.L
        n, qk = m.num_attention_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        up = self._again("mla_up_proj")
        w = _linear(2 * L * m.hidden_size * m.q_lora_rank, self.trains, self.pre_core_dgrad,
                    self._again())
        w += _linear(2 * L * m.q_lora_rank * n * qk, self.trains, self.pre_core_dgrad, up)
        w += _linear(2 * L * m.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim), self.trains,
                     self.pre_core_dgrad, self._again())
        # per-head k/v of the tokens the core reads (kv_up_projection.py): sparse mode reads
        # only the dense prefix's; under CP each rank up-projects the gathered latent of the
        # whole sequence (dsa/attention.py _gathered_key_value) and one local token
        read = min(m.dsa.topk, L) if self.mode == "sparse" else L
        expanded = self.cp * (read + 1) if self.cp > 1 else read
        w += _linear(2 * expanded * m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim),
                     self.trains, self.pre_core_dgrad, up)
        w += _linear(2 * L * n * m.v_head_dim * m.hidden_size, self.trains, self.dgrad, self._again())
        return w

    def ffn(self) -> _Work:
        m, L, h = self.m, self.L, self.m.hidden_size
        if not self.moe:
            return _linear(6 * L * h * m.ffn_hidden_size, self.trains, self.dgrad, self._again("mlp"))
        moe = self._again("moe")
        # megatron's router GEMM always forms its weight gradient (RouterGatingLinearFunction),
        # but for the warm-up's frozen forward
        router = _linear(2 * L * h * m.num_experts, self.dgrad, self.dgrad, moe)
        routed = _linear(6 * L * h * m.moe_ffn_hidden_size * m.moe_topk, self.trains, self.dgrad, moe)
        shared = _linear(6 * L * h * m.moe_ffn_hidden_size * m.num_shared_experts, self.trains,
                         self.dgrad, moe or self._again("shared_experts"))
        return router + routed + shared

    def _dense_core(self, limit: int) -> _Work:
        """Softmax attention of the queries at positions < ``limit`` over the keys each sees: S
        and PV forward; backward recomputes S and forms dP, dV, dQ, dK (none of it when the
        inputs need no gradient). Under CP the blocked path runs (``dsa/dense_attention.py``):
        a block of rows computes every key up to its last row (masked), and its backward first
        recomputes the block's forward."""
        m = self.m
        n, qk, dv = m.num_attention_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        blocked = self.cp > 1
        pairs = _blocked_pairs(self.L, self.cp, limit) if blocked else _triangle(0, limit)
        fwd = 2 * pairs * n * (qk + dv)
        bwd = 2 * pairs * n * (3 * qk + 2 * dv) + (fwd if blocked else 0)
        return _Work(fwd, bwd if self.pre_core_dgrad else 0, fwd if self._again("core_attn") else 0)

    def attention(self) -> _Work:
        m, L = self.m, self.L
        if self.mode != "sparse":
            return self._dense_core(L)
        k = m.dsa.topk
        prefix = min(k, L)
        rows = L - prefix
        n, nope, rope = m.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
        lora, dv = m.kv_lora_rank, m.v_head_dim
        again = self._again("core_attn")
        # q W_UK and O W_UV: products with the kv up-projection's weight (it trains)
        absorb = _linear(2 * rows * n * lora * (nope + dv), True, True, again)
        fwd = 2 * rows * k * n * ((lora + rope) + lora)  # S over latent + rope dims, P C
        bwd = 2 * rows * k * n * (3 * (lora + rope) + 2 * lora)  # S again, dP, dC (values), dQ, dC (keys)
        return self._dense_core(prefix) + absorb + _Work(fwd, bwd, fwd if again else 0)

    def indexer(self) -> _Work:
        """Cluster-wide: the part every TP rank repeats counts ``tp`` times."""
        split, replicated = self.indexer_parts()
        return split + replicated * self.tp

    def indexer_parts(self) -> tuple[_Work, _Work]:
        """(the dense KL's target, the main heads' scores: split over TP like them; the rest,
        which every TP rank computes whole: the indexer's heads are not split and it reads the
        TP-gathered sequence)."""
        m, L, d = self.m, self.L, self.m.dsa
        if self.mode in ("dense", "none"):
            return _Work(), _Work()
        H, hd, h = d.index_heads, d.index_head_dim, m.hidden_size
        again = self._again("core_attn")
        proj = _linear(2 * L * (m.q_lora_rank * H * hd + h * hd + h * H), True, False, again)
        n, qk = m.num_attention_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        score = 2 * H * hd + 2 * H  # per (query, key): per-head q.k, weighted head sum
        grads = 2 * H + 4 * H * hd  # d w, d q, d k (formed in the KL's forward)

        def kl(pairs: int) -> _Work:
            return _Work(pairs * (score + grads), 0.0, pairs * score if again else 0)

        def target(pairs: int) -> _Work:
            fwd = pairs * 2 * n * qk
            return _Work(fwd, 0.0, fwd if again else 0)

        if self.mode == "warmup":
            pairs = _triangle(0, L)
            return target(pairs), proj + kl(pairs)
        k = d.topk
        prefix = min(k, L)
        select = _triangle(prefix, L) * score  # rows >= topk score all their visible keys
        rest = proj + kl(_triangle(0, prefix)) + kl((L - prefix) * k) + \
            _Work(select, 0.0, select if again else 0)
        return target(_triangle(0, prefix)), rest


def _eh_proj(m: GLM5Config, L: int) -> _Work:
    """MTP's projection of [embedding; hidden] (2h -> h)."""
    trains = m.dsa.mode != "warmup"  # the warm-up's frozen forward: no backward, no recomputation
    return _linear(2 * L * 2 * m.hidden_size * m.hidden_size, trains, trains, trains and m.recompute == "full")


def _output_head(m: GLM5Config, L: int, tp: int) -> _Work:
    trains = m.dsa.mode != "warmup"
    return _linear(2 * L * m.hidden_size * m.padded_vocab_size(tp), trains, trains)


@dataclass(frozen=True)
class WorkPerToken:
    """FLOPs per token of one part of the model by kind, for time estimates, each including
    recomputed forwards: ``gemm`` (linear layers), ``attention`` (the attention core, dense or
    sparse) and ``indexer`` (its KL target), which TP splits over its ranks, and ``replicated``
    (the rest of the lightning indexer), which every TP rank computes whole. ``model`` is the
    cluster-wide count without recomputation (``replicated`` once per TP rank)."""

    gemm: float
    attention: float
    indexer: float
    replicated: float
    model: float

    @property
    def hardware(self) -> float:
        """One TP rank's share of the recomputation-included work, times ``tp``, is
        ``gemm + attention + indexer + tp * replicated``; this is it at tp = 1."""
        return self.gemm + self.attention + self.indexer + self.replicated

    def __add__(self, o: "WorkPerToken") -> "WorkPerToken":
        return WorkPerToken(self.gemm + o.gemm, self.attention + o.attention,
                            self.indexer + o.indexer, self.replicated + o.replicated,
                            self.model + o.model)


def _per_token(L: int, tp: int, gemm: _Work, attention: _Work, split: _Work,
               replicated: _Work) -> WorkPerToken:
    parts = (gemm, attention, split, replicated)
    return WorkPerToken(*((w.total + w.again) / L for w in parts),
                        (gemm.total + attention.total + split.total + tp * replicated.total) / L)


def _parts(m: GLM5Config, L: int, index: int, tp: int = 1,
           cp: int = 1) -> tuple[_Work, _Work, _Work, _Work]:
    """(linear layers, attention core, indexer KL target, rest of the indexer: one TP rank's
    copy) of decoder layer ``index`` (0-based)."""
    layer = _Layer(m, L, bool(m.num_experts) and index >= m.first_k_dense,
                   tp=tp, cp=cp)
    return (layer.projections() + layer.ffn(), layer.attention(), *layer.indexer_parts())


def _post_parts(m: GLM5Config, L: int, tp: int = 1,
                cp: int = 1) -> tuple[_Work, _Work, _Work, _Work, _Work]:
    """(MTP linear layers, MTP attention, MTP indexer target, rest of the MTP indexer, output
    heads) at all MTP steps."""
    if not m.mtp_num_steps:
        return _Work(), _Work(), _Work(), _Work(), _output_head(m, L, tp)
    layer = _Layer(m, L, bool(m.num_experts) and m.num_layers > m.first_k_dense, tp=tp, cp=cp)
    k = m.mtp_num_steps
    split, replicated = layer.indexer_parts()
    return ((_eh_proj(m, L) + layer.projections() + layer.ffn()) * k, layer.attention() * k,
            split * k, replicated * k, _output_head(m, L, tp) * (1 + k))


def layer_work(m: GLM5Config, seq_length: int, index: int, tp: int = 1, cp: int = 1) -> WorkPerToken:
    """Decoder layer ``index`` (0-based: dense for the first ``first_k_dense``, MoE after)."""
    return _per_token(seq_length, tp, *_parts(m, seq_length, index, tp, cp))


def post_work(m: GLM5Config, seq_length: int, tp: int = 1, cp: int = 1) -> WorkPerToken:
    """What the last pipeline rank runs after the decoder: the MTP module at every step and the
    output heads (counted as linear layers)."""
    mtp, attn, split, replicated, heads = _post_parts(m, seq_length, tp, cp)
    return _per_token(seq_length, tp, mtp + heads, attn, split, replicated)


def mtp_work(m: GLM5Config, seq_length: int, tp: int = 1, cp: int = 1) -> WorkPerToken:
    """The MTP module at every step (its output heads apart: :func:`output_head_work`)."""
    mtp, attn, split, replicated, _ = _post_parts(m, seq_length, tp, cp)
    return _per_token(seq_length, tp, mtp, attn, split, replicated)


def output_head_work(m: GLM5Config, seq_length: int, tp: int = 1) -> WorkPerToken:
    """One output head (the LM's or an MTP step's), counted as a linear layer."""
    zero = _Work()
    return _per_token(seq_length, tp, _output_head(m, seq_length, tp), zero, zero, zero)


def flops_per_token(m: GLM5Config, seq_length: int, tp: int = 1, cp: int = 1) -> FlopsPerToken:
    """Exact training FLOPs per token of ``m`` at ``seq_length`` in its DSA mode (see the module
    doc), counted over the whole cluster: ``tp`` pads the vocabulary as megatron does and
    repeats the lightning indexer's work on every TP rank (its heads are not split); ``cp`` > 1
    adds what context parallelism computes on top (every rank re-expands the gathered kv
    latent; blocked dense attention)."""
    L = seq_length
    if L < 1 or cp < 1 or (cp > 1 and L % (2 * cp)):
        raise ValueError(f"seq_length={seq_length} must be >= 1 and a multiple of 2 * cp (cp={cp})")
    dense = attention = indexer = _Work()
    for i in range(m.num_layers):
        g, a, split, replicated = _parts(m, L, i, tp, cp)
        dense, attention, indexer = dense + g, attention + a, indexer + split + replicated * tp
    mtp_gemm, mtp_attn, split, replicated, heads = _post_parts(m, L, tp, cp)
    mtp = mtp_gemm + mtp_attn + split + replicated * tp
    parts = (dense, attention, indexer, mtp, heads)
    return FlopsPerToken(
        dense=dense.total / L, attention=attention.total / L, indexer=indexer.total / L,
        mtp=mtp.total / L, output_heads=heads.total / L,
        total=sum(p.total for p in parts) / L,
        recompute=sum(p.again for p in parts) / L,
        forward=sum(p.fwd for p in parts) / L,
    )


def train_flops_per_token(c: GLM5Config, seq_length: int) -> float:
    """Exact training FLOPs per token (``flops_per_token(...).total``; the step metrics'
    ``tflops_per_s``)."""
    return flops_per_token(c, seq_length).total


def attention_matmul_params(c: GLM5Config) -> int:
    """Weights of MLA's five projections (q down/up, kv down/up, output)."""
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    return (
        c.hidden_size * c.q_lora_rank
        + c.q_lora_rank * c.num_attention_heads * qk
        + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
        + c.num_attention_heads * c.v_head_dim * c.hidden_size
    )


def megatron_flops_per_token(m: GLM5Config, seq_length: int, tp: int = 1) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for this model, per token (it is linear in
    the batch): MLA, SwiGLU, ``moe_layer_freq`` = ``first_k_dense`` dense layers then MoE,
    ``mtp_num_layers = mtp_num_steps``, vocabulary padded for ``tp``."""
    h, n, L = m.hidden_size, m.num_attention_heads, seq_length
    moe = bool(m.num_experts)
    steps = m.mtp_num_steps
    num_moe = m.num_moe_layers
    num_dense = m.num_layers - num_moe
    last_is_moe = moe and m.num_layers > m.first_k_dense
    num_moe += steps if last_is_moe else 0
    num_dense += 0 if last_is_moe else steps
    shared = m.num_shared_experts * m.moe_ffn_hidden_size if moe else 0
    topk = m.moe_topk if moe else 0
    q_term = m.q_lora_rank * (h + n * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 1)
    attn = 6 * (
        q_term
        + m.kv_lora_rank * (h + n * (m.qk_nope_head_dim + m.v_head_dim) + 1)
        + h * m.qk_rope_head_dim
        + n * m.v_head_dim * h
        + L * n * (m.qk_nope_head_dim + m.qk_rope_head_dim) / 2
        + L * n * m.v_head_dim / 2
    )
    mlp = 6 * h * (3 * m.ffn_hidden_size * num_dense
                   + 3 * m.moe_ffn_hidden_size * topk * num_moe
                   + 3 * shared * num_moe)
    mtp = 6 * steps * (3 * h + 2 * h * h)
    logits = 6 * h * m.padded_vocab_size(tp) * (steps + 1)
    return mlp + attn * (m.num_layers + steps) + mtp + logits
