"""Activation memory of one pipeline rank during a training step, from the config alone.

Counted is what this project's GLM-5 layers keep for the backward pass (every tensor autograd
saves, once per storage), per micro-batch: MLA's low-rank path (down-projections, q/kv norms,
up-projections, RoPE), the core attention (dense: SDPA's output and log-sum-exp; sparse: the
indexer, top-k indices, the absorbed sparse attention and the sparse KL), the MoE router, dispatcher and experts (balanced routing;
6 values of ``moe_ffn / etp`` per routed token: fc1's two halves, SiLU, the linear half, their
product and its prob-weighted copy), the shared expert and dense FFN (5 per token), the norms,
the embedding (first stage), the shared MTP layer run ``mtp_num_steps`` times and the output
heads' fp32 softmax (last stage). Tokens: CP splits the sequence (``seq / cp`` per rank); under
sequence parallelism the residual stream (norms, residual adds, router, down-projections) holds
``1/tp`` of those and the TP regions (attention, FFNs, experts) all of them with ``1/tp`` of the
heads and widths; under CP the keys and values are the whole gathered sequence (the all-gather
CP of ``GLM5MLASelfAttention``).

Recomputation is megatron-core 0.19.2's. ``selective`` drops what ``recompute_modules`` names --
``core_attn`` the core attention's internals, ``mla_up_proj`` q, k, v and their RoPE (under CP
the gathered keys and values stay), ``layernorm`` the two layer norms' outputs, ``mlp`` dense
FFNs, ``moe`` the MoE block but its routing metadata, ``moe_act`` the experts' activation
(grouped-GEMM experts only), ``shared_experts`` -- and brings one layer's share back in its
backward; ``full`` keeps each layer's and each MTP depth's input and recomputes one at a time.

Two backends keep different things; the model follows the run's:
- ``local`` (CPU; what the tests measure): torch's RMSNorm keeps its fp32 normalised input, the
  experts are one MLP each (``SequentialMLP``: ``moe_act`` does nothing) and the
  sequence-parallel all-gathers go to megatron's persistent global buffer.
- ``te`` (GPUs, Transformer Engine): norms keep only the fp32 inverse RMS (input and output are
  kept by their neighbours), the experts are grouped GEMMs and the all-gathered inputs are
  transient; bf16 logits are upcast to fp32 for the cross entropy. FP8 linear layers would
  keep fp8 copies of their inputs besides: not counted.
``model.layer_backend: auto`` is taken as ``te`` for bf16 runs and ``local`` for fp32 ones.

The DSA warm-up runs the frozen network without autograd (``dsa.modes.indexer_only_forward``):
a micro-batch keeps only each indexer's parameter gradients, computed in its layer's forward, and
the chunk's input; the working memory is one layer's KL. In sparse mode the queries
before position ``topk`` (all on CP rank 0) take the dense path, whose SDPA keeps the layer's
full keys and values alive: CP rank 0 holds the most, and is the default rank estimated.

Peak: the schedule decides how many micro-batches' activations are held -- one without a
pipeline; 1F1B ``min(pp - pp_rank, micro-batches)``; the interleaved schedule is replayed
(megatron's warm-up ``2 (pp - rank - 1) + (vpp - 1) pp`` and chunk table) for its largest held
set. The backward then first runs the output heads (softmax gradients, the output layer's weight
gradient), then the layers (one recomputed layer, gradients in flight, MoE combine buffers)
after the heads' softmax is gone: the peak is the larger of the two moments.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32, INT64 = 4, 8


@dataclass(frozen=True)
class ActivationBytes:
    """Activation memory of one pipeline rank (every TP/CP/EP/DP rank of it alike), bytes."""

    #: saved-for-backward bytes of one micro-batch, all its chunks (the heads' softmax apart)
    per_microbatch: int
    in_flight: float  #: micro-batches of ``per_microbatch`` held at the schedule's peak
    dispatcher: int  #: one MoE layer's dispatch/combine buffers (transient)
    #: the heads' fp32 softmax of the held micro-batches + the heads' backward transients
    logits: int
    working: int  #: one layer's backward: its recomputed tensors and the gradients in flight
    buffers: int  #: a sequence-parallel all-gather of a layer input (``_sp_gather``)
    #: buffers + held (in_flight * per_microbatch) + the larger of: logits (the heads' backward);
    #: working + (dispatcher - gradients in flight, if positive: the MoE buffers live in a
    #: layer's (re)computed forward, the gradients after it) + other held micro-batches' softmax
    peak: int


@dataclass(frozen=True)
class _Dims:
    """Sizes on one rank per micro-batch: ``r`` residual-stream tokens, ``q`` tokens of the TP
    regions (this rank's queries), ``k`` keys (the CP-gathered sequence), times ``b``."""

    a: int  #: bytes of an activation value
    b: int  #: micro-batch size
    r: int
    q: int
    k: int
    tp: int
    etp: int
    heads: int  #: attention heads of this TP rank
    te: bool  #: Transformer Engine layers (module docstring)
    plain_causal: bool  #: no CP: SDPA with is_causal, which also keeps its log-sum-exp
    prefix: int  #: sparse mode: CP rank 0's query tokens before position topk (dense prefix)

    @property
    def positions(self) -> int:
        """This rank's query positions (RoPE tables are per position, shared by the samples)."""
        return self.q // self.b


def activation_bytes(rc, layout, pp_rank: int, backend: str | None = None,
                     cp_rank: int = 0) -> ActivationBytes:
    """Activation bytes of pipeline rank ``pp_rank`` for a stage's resolved ``RunConfig`` ``rc``
    on its validated ``parallel.config.Layout``. ``backend``: ``local`` | ``te`` (default: the
    run's ``model.layer_backend``; ``auto`` is ``te`` for bf16, ``local`` for fp32). ``cp_rank``
    matters in sparse mode only (CP rank 0, the default, holds the dense prefix: the most)."""
    par, m, t = rc.parallel, rc.model, rc.trainer
    backend = backend or {"te": "te", "local": "local"}.get(
        m.layer_backend, "te" if rc.precision.dtype == "bf16" else "local")
    _check(rc, layout, pp_rank, backend, cp_rank)
    d = _dims(rc, backend, cp_rank)
    chunks = _rank_chunks(rc, layout, pp_rank)
    saved = [_chunk_saved(d, m, layers, first, mtp, loss) for layers, first, mtp, loss in chunks]
    per_mb = sum(saved)
    micro_batches = t.global_batch_size // (t.micro_batch_size * layout.dp)
    loss_v = next((v for v, c in enumerate(chunks) if c[3]), None)
    held, loss_held = _held_at_peak(saved, par.pp, pp_rank, par.virtual_stages, micro_batches,
                                    par.virtual_stages - 1 if loss_v is None else loss_v)
    has_mtp = any(c[2] for c in chunks) and bool(m.mtp_num_steps)
    has_loss = loss_v is not None
    moe_here = any(_is_moe(m, i) for layers, _, _, _ in chunks for i in layers)
    moe_here |= has_mtp and _is_moe(m, m.num_layers - 1)
    dispatcher = _dispatcher(d, m) if moe_here else 0
    working = max(_working(d, m, layers, mtp, loss) for layers, _, mtp, loss in chunks)
    logits, other_logits = 0, 0
    if has_loss:
        kept, transient = _logits(d, m, par.tp)
        logits = loss_held * kept + transient
        other_logits = max(loss_held - 1, 0) * kept
    layers_phase = other_logits + working + max(0, dispatcher - _gradients(d, m, has_loss))
    buffers = _sp_gather(d, m, has_mtp)
    peak = buffers + held + max(logits, layers_phase)
    return ActivationBytes(per_mb, held / per_mb if per_mb else 0.0, dispatcher, logits, working,
                           buffers, peak)


def _check(rc, layout, pp_rank: int, backend: str, cp_rank: int) -> None:
    par = rc.parallel
    if backend not in ("te", "local"):
        raise ValueError(f"backend={backend!r} must be te or local")
    if not 0 <= pp_rank < par.pp:
        raise ValueError(f"pp_rank={pp_rank} is outside parallel.pp={par.pp}")
    if not 0 <= cp_rank < par.cp:
        raise ValueError(f"cp_rank={cp_rank} is outside parallel.cp={par.cp}")
    if len(layout.layers_per_stage) != par.pp * par.virtual_stages:
        raise ValueError(f"layout has {len(layout.layers_per_stage)} model chunks, but parallel.pp="
                         f"{par.pp} x vpp={par.virtual_stages}: the layout is not this config's")


def _dims(rc, backend: str, cp_rank: int) -> _Dims:
    par, m, t = rc.parallel, rc.model, rc.trainer
    b, seq = t.micro_batch_size, t.seq_length
    local = seq // par.cp
    residual = local // par.tp if par.sequence_parallel else local
    prefix = 0
    if m.dsa.mode == "sparse":  # queries before position topk (zigzag chunks r and 2cp-1-r)
        half = local // 2 if par.cp > 1 else local
        starts = (cp_rank * half, (2 * par.cp - 1 - cp_rank) * half) if par.cp > 1 else (0,)
        prefix = sum(min(max(m.dsa.topk - lo, 0), half) for lo in starts)
    return _Dims(a=2 if rc.precision.dtype == "bf16" else FP32, b=b, r=residual * b, q=local * b,
                 k=seq * b, tp=par.tp, etp=par.expert_tp, heads=m.num_attention_heads // par.tp,
                 te=backend == "te", plain_causal=par.cp == 1, prefix=prefix * b)


def _is_moe(m, layer: int) -> bool:
    return bool(m.num_experts) and layer >= m.first_k_dense


def _rank_chunks(rc, layout, pp_rank: int) -> list:
    """(global layer numbers, holds the embedding, holds the MTP module, holds the loss and the
    output heads) per model chunk of this rank, in virtual-stage order (``layout.layers_per_stage``
    is in model order; ``parallel.pipeline_layout`` places the pieces, else the first and last
    chunks hold them)."""
    pp, v = rc.parallel.pp, rc.parallel.virtual_stages
    counts = layout.layers_per_stage
    last = pp * v - 1

    def at(piece: str, default: int) -> int:
        c = getattr(layout, f"{piece}_chunk", default)
        return last if c is None or c < 0 else c

    embedding, mtp, loss = at("embedding", 0), at("mtp", last), at("loss", last)
    out = []
    for vp in range(v):
        index = vp * pp + pp_rank
        start = sum(counts[:index])
        out.append((range(start, start + counts[index]), index == embedding, index == mtp, index == loss))
    return out


def _drop(m) -> frozenset:
    """What recomputation drops: ``recompute_modules`` (selective), {"full"} or nothing."""
    if m.recompute == "full":
        return frozenset({"full"})
    return frozenset(m.recompute_modules) if m.recompute == "selective" else frozenset()


def _norm(d: _Dims, width: int, tokens: int) -> int:
    """What an RMSNorm keeps besides its input and output: TE, the fp32 inverse RMS; local
    (``F.rms_norm`` decomposed, in fp32), the inverse RMS, the normalised input and, for a
    bf16 input, its fp32 copy."""
    if d.te:
        return tokens * FP32
    return tokens * FP32 * (1 + width * (1 if d.a == FP32 else 2))


def _attention(d: _Dims, m, drop) -> int:
    """MLA after the input norm, to the core attention's output (the output projection's
    input)."""
    n, nope, rope, v = d.heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    c, ql = m.kv_lora_rank, m.q_lora_rank
    out = d.r * d.a * (ql + c + rope)  # the down-projections' outputs
    out += _norm(d, ql, d.r) + _norm(d, c, d.r) + d.r * d.a * (ql + c)  # q/kv norms, outputs
    out += d.positions * rope * FP32  # the layer's RoPE frequencies (megatron caches them)
    cp = d.k != d.q
    if "mla_up_proj" not in drop:
        out += d.q * d.a * n * (nope + rope) + d.positions * d.a * 4 * rope  # query, cos/sin
        if not cp and (m.dsa.mode != "sparse" or d.prefix):
            out += d.q * d.a * n * (nope + rope + v)  # key, value
    if cp:  # the gathered latent and the whole sequence's key and value (sparse: the prefix's)
        out += d.k * d.a * c
        if m.dsa.mode != "sparse":
            out += d.k * d.a * n * (nope + rope + v)
        elif d.prefix:  # the dense prefix's rows only: the later queries read the latent
            out += d.b * min(m.dsa.topk, d.k // d.b) * d.a * n * (nope + rope + v)
    out += d.q * d.a * n * v
    return out + (0 if "core_attn" in drop else _core_internals(d, m))


def _core_internals(d: _Dims, m) -> int:
    """What the DSA core attention keeps besides its inputs and output."""
    n, dsa = d.heads, m.dsa
    lse = d.q * n * FP32 if d.plain_causal else 0
    if dsa.mode in ("dense", "none"):
        return lse
    out = _indexer_saved(d, m)
    if dsa.mode == "warmup":
        return out + lse
    rope, c, hd = m.qk_rope_head_dim, m.kv_lora_rank, dsa.index_head_dim
    rows, kk = d.q - d.prefix, min(dsa.topk, d.k // d.b)
    if d.prefix:  # the dense prefix: its KL's key gradient and SDPA's log-sum-exp
        out += d.b * kk * hd * FP32 + (d.prefix * n * FP32 if d.plain_causal else 0)
    out += rows * kk * (INT64 + 1)  # top-k indices and their visibility
    out += rows * (d.a * n * (2 * c + rope) + n * FP32)  # absorbed q, latent output, lse
    if d.b > 1:  # the absorption einsums' batched copies of q_nope and the latent output
        out += rows * d.a * n * (m.qk_nope_head_dim + c)
    return out + d.k * d.a * (c + rope)  # the latent key rows


def _indexer_saved(d: _Dims, m) -> int:
    """What the lightning indexer and its KL keep for backward."""
    dsa = m.dsa
    heads, hd, rope = dsa.index_heads, dsa.index_head_dim, m.qk_rope_head_dim
    out = d.q * (d.a * hd + 2 * FP32) + d.positions * d.a * rope  # wk out, k_norm stats, RoPE
    # the indexer reads the layer input and q latent batch-first: new tensors when SP gathered
    # them, or when the transpose is not free (b > 1: wk and weights_proj each keep a copy)
    if d.b > 1:
        out += d.q * d.a * (2 * m.hidden_size + m.q_lora_rank)
    elif d.tp > 1:
        out += d.q * d.a * (m.hidden_size + m.q_lora_rank)
    return out + d.q * heads * (hd + 1) * FP32 + d.k * hd * FP32  # the KL's eager gradients


def _ffn(d: _Dims, m, moe: bool, drop) -> int:
    """After the pre-MLP norm: a dense SwiGLU, or router + dispatcher + experts + shared."""
    if not moe:
        return 0 if "mlp" in drop else d.q * d.a * 5 * m.ffn_hidden_size // d.tp
    e, k = m.num_experts, m.moe_topk
    out = _routing(d, m)
    if "moe" in drop:
        return out
    out += d.r * (13 * e + 12 * k + 4)  # router scores and probabilities (fp32), top-k
    routed = k * d.r * d.etp  # tokens this rank's experts see: the EP all-to-all, ETP gather
    act = 2 if d.te and "moe_act" in drop else 6
    out += routed * (d.a * (m.hidden_size + act * m.moe_ffn_hidden_size // d.etp) + FP32)
    if m.num_shared_experts and "shared_experts" not in drop:
        out += d.q * d.a * 5 * m.num_shared_experts * m.moe_ffn_hidden_size // d.tp
    return out


def _routing(d: _Dims, m) -> int:
    """The dispatcher's routing map and unpermute mapping (its attributes until the layer's next
    forward: kept under any recomputation)."""
    return d.r * (m.num_experts + m.moe_topk * INT64)


def _layer(d: _Dims, m, moe: bool, drop) -> int:
    """One decoder layer application: its input not included, its output included."""
    h = m.hidden_size
    if "full" in drop:  # the next checkpoint's input, routing metadata, RoPE cache
        rope = d.positions * m.qk_rope_head_dim * FP32
        return d.r * d.a * h + (_routing(d, m) if moe else 0) + rope
    # layernorm recomputation frees the norms' outputs (their consumers' saved inputs too)
    norms = 0 if "layernorm" in drop else 2 * (_norm(d, h, d.r) + d.r * d.a * h)
    residual = 2 * d.r * d.a * h  # after the attention, after the FFN (the layer's output)
    return norms + residual + _attention(d, m, drop) + _ffn(d, m, moe, drop)


def _mtp_depth(d: _Dims, m, last: bool, drop) -> int:
    """One MTP depth: embedding, enorm/hnorm, their concat, eh_proj's output (TP-gathered: whole
    tokens), the layer, the final norm (its output feeds the next depth; the last depth's only
    the block's concat)."""
    h = m.hidden_size
    moe = _is_moe(m, m.num_layers - 1)
    emb = d.r * d.a * h + (d.q * (INT64 + 1) if d.tp > 1 else 0)
    out_kept = 0 if last else d.r * d.a * h
    if "full" in drop:
        return emb + out_kept + (_routing(d, m) if moe else 0)
    concat = 2 * d.r * d.a * h + d.q * d.a * h
    return emb + 3 * _norm(d, h, d.r) + concat + out_kept + _layer(d, m, moe, drop)


def _chunk_saved(d: _Dims, m, layers, first: bool, mtp: bool, loss: bool) -> int:
    """Saved bytes of one micro-batch on one model chunk (the heads' softmax apart): its layers,
    the MTP depths where it holds the MTP module, the final norm and the heads' inputs where it
    holds the loss."""
    h, drop = m.hidden_size, _drop(m)
    out = d.r * d.a * h  # the chunk's input: the embedding's output or the received activations
    steps = m.mtp_num_steps
    if m.dsa.mode == "warmup":  # the frozen forward keeps only each indexer's parameter gradients
        d_idx, h = m.dsa, m.hidden_size
        params = d_idx.index_heads * d_idx.index_head_dim * m.q_lora_rank + d_idx.index_head_dim * h \
            + d_idx.index_heads * h + 2 * d_idx.index_head_dim
        return out + (len(layers) + (1 if mtp and steps else 0)) * params * d.a
    if first and d.tp > 1:  # the vocab-parallel embedding's masked ids and mask
        out += d.q * (INT64 + 1)
    out += sum(_layer(d, m, _is_moe(m, i), drop) for i in layers)
    if mtp:
        out += sum(_mtp_depth(d, m, s == steps - 1, drop) for s in range(steps))
    if loss:
        out += _norm(d, h, d.r) + d.r * d.a * h  # final norm and its output
        out += (1 + steps) * d.r * d.a * h if steps else 0  # the heads' inputs (MTP concat)
    return out


def _logits(d: _Dims, m, tp: int) -> tuple:
    """(saved per micro-batch: each head's fp32 softmax and targets; transient in a head's
    backward: the output layer's weight and input gradients, and the logits' gradient cast to
    a reduced activation dtype)."""
    vocab, h = m.padded_vocab_size(tp) // tp, m.hidden_size
    if m.dsa.mode == "warmup":  # the frozen forward: one head's fp32 logits at a time, no backward
        return 0, d.q * vocab * FP32
    saved = (1 + m.mtp_num_steps) * d.q * (vocab * FP32 + INT64 + 1)
    cast = d.q * vocab * d.a if d.a != FP32 else 0
    return saved, cast + (vocab * h + d.q * h) * d.a


def _dispatcher(d: _Dims, m) -> int:
    """One MoE layer's buffers at its combine: the permuted local tokens, the experts' output
    and its copy sorted back (expert-TP-gathered tokens), the shared expert's output."""
    k, h = m.moe_topk, m.hidden_size
    shared = d.r * h if m.num_shared_experts else 0
    return d.a * (h * k * d.r * (1 + 2 * d.etp) + shared)


def _working(d: _Dims, m, layers, mtp: bool, loss: bool) -> int:
    """One layer's backward: what recomputation brings back (the chunk's largest layer, or an
    MTP depth) and the gradients in flight."""
    if m.dsa.mode == "warmup":  # no backward of the frozen layers: one indexer's KL at work in forward
        return _indexer_saved(d, m)
    drop, none = _drop(m), frozenset()
    recomputed = [_layer(d, m, moe, none) - _layer(d, m, moe, drop)
                  for moe in {_is_moe(m, i) for i in layers}]
    if mtp and m.mtp_num_steps:
        recomputed.append(_mtp_depth(d, m, False, none) - _mtp_depth(d, m, False, drop))
    return max(recomputed, default=0) + _gradients(d, m, loss)


def _gradients(d: _Dims, m, last: bool) -> int:
    """Gradients in flight in a layer's backward: the incoming one (on the last chunk with MTP,
    the heads' whole concatenated input) and the layer's own two residual-stream ones."""
    incoming = 1 + m.mtp_num_steps if last else 1
    return (incoming + 2) * d.r * d.a * m.hidden_size


def _sp_gather(d: _Dims, m, last: bool) -> int:
    """Under sequence parallelism a column-parallel layer all-gathers its input (the widest:
    the MTP's [enorm | hnorm] concat, else the hidden states): into megatron's global buffer,
    allocated once and kept (local), or a fresh tensor per call (TE)."""
    if d.tp == 1:
        return 0
    return d.q * d.a * m.hidden_size * (2 if last and m.mtp_num_steps else 1)


def _held_at_peak(saved: list, pp: int, rank: int, vpp: int, micro_batches: int,
                  loss_chunk: int | None = None) -> tuple:
    """(most bytes of (micro-batch, chunk) activations held at once, how many of those are
    micro-batches of virtual chunk ``loss_chunk``: the one holding the heads, default the last),
    replaying megatron's schedule: no pipeline, 1F1B or interleaved."""
    loss_chunk = vpp - 1 if loss_chunk is None else loss_chunk
    if pp == 1:
        return saved[0], 1
    total = micro_batches * vpp
    if vpp == 1:
        warmup, order = pp - rank - 1, [0] * total
    else:
        warmup = 2 * (pp - rank - 1) + (vpp - 1) * pp
        order = _interleaved_chunk_order(micro_batches, vpp, pp)
    warmup = min(warmup, total)
    held, best, best_last, backward = [], 0, 0, 0
    for i in range(total):
        held.append(order[i])
        size = sum(saved[c] for c in held)
        if size > best:
            best, best_last = size, held.count(loss_chunk)
        if i >= warmup:  # steady state: each forward is followed by the oldest backward
            held.remove(vpp - 1 - order[backward])
            backward += 1
    return best, best_last


def _interleaved_chunk_order(micro_batches: int, vpp: int, group: int) -> list:
    """Model chunk of each forward in megatron's interleaved schedule table (``group`` = pp
    micro-batches per chunk in turn)."""
    order = []
    for lo in range(0, micro_batches, group):
        hi = micro_batches if lo + group >= micro_batches else lo + group
        order += [c for c in range(vpp) for _ in range(lo, hi)]
    return order
