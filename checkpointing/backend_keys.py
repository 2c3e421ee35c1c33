"""Tensor names of the two layer backends, and loading a checkpoint one wrote into the other.

Both backends build the same network (``specs.py``), but Transformer Engine (``te``) and the
local torch layers (``local``) name three things differently:

1. **The dense layers' pre-MLP RMSNorm.** TE fuses it into the MLP's first linear
   (``TELayerNormColumnParallelLinear``): ``<layer>.mlp.linear_fc1.layer_norm_weight``; the local
   spec keeps ``<layer>.pre_mlp_layernorm.weight``. MoE layers (and the MTP module's inner layer,
   a MoE layer like the last decoder layer) keep a separate ``pre_mlp_layernorm`` in both: the
   routed experts have no fused fc1. MLA's q/kv norms are separate in both (``specs.py`` turns
   TE's fusion into ``linear_q_up_proj`` / ``linear_kv_up_proj`` off), so ``q_layernorm`` and
   ``kv_layernorm`` keep their names.
2. **Routed experts in a module's state dict.** Local ``SequentialMLP``:
   ``mlp.experts.local_experts.<e>.linear_fc<j>.weight``; TE's grouped GEMM:
   ``mlp.experts.linear_fc<j>.weight<e>`` (extra state, per GEMM in its sharded state dict:
   ``linear_fc<j>._extra_state`` for e = 0, ``_extra_state<e>`` after). Their checkpoint keys
   agree: megatron writes both as ``mlp.experts.experts.linear_fc<j>.weight`` with an expert axis.
3. **Extra state only TE has.** TE's RMSNorm and its duplicated ``Linear`` (MLA's
   ``linear_q_down_proj`` / ``linear_kv_down_proj``) store ``_extra_state`` (FP8 metadata);
   the local norms and modelopt ``Linear`` store none. The column/row-parallel linears store one
   in both.

The maps work on any key that holds a layer name: module state-dict keys, sharded-state-dict
keys, checkpoint (global) keys, also behind a prefix (``optimizer.state.exp_avg.<param key>``).
``local -> te -> local`` is the identity, and every local key is already a fixed point of
``te -> local``, so names of either backend can be normalised with :func:`te_to_local`.
"""

from __future__ import annotations

import re
from typing import Callable, Container, Iterable, Optional

LOCAL, TE = "local", "te"
BACKENDS = (LOCAL, TE)
COMMON_KEY = "layer_backend"  #: common-state entry: the backend whose naming the checkpoint uses

#: a transformer layer's prefix, at the start of a key or after a '.'
#: (the MTP layer's is ``mtp_model_layer`` in megatron 0.19's module names, ``transformer_layer``
#: in its checkpoint keys, as in 0.16's)
_LAYER = re.compile(r"(?<![^.])(decoder\.layers\.\d+\.|mtp\.layers\.\d+\.(?:transformer|mtp_model)_layer\.)")
#: modules inside a layer that are TE norms / TE ``Linear`` but carry no extra state locally
#: (``pre_mlp_layernorm`` only in MoE layers: a dense layer's is fused into ``mlp.linear_fc1``)
_TE_ONLY_IN_LAYER = ("input_layernorm", "self_attention.q_layernorm", "self_attention.kv_layernorm",
                     "self_attention.linear_q_down_proj", "self_attention.linear_kv_down_proj")
_MOE_NORM = "pre_mlp_layernorm"
#: extra state of the TE norms outside the transformer layers
_TE_ONLY_OUTSIDE = re.compile(
    r"(?<![^.])(?:decoder\.final_layernorm|mtp\.layers\.\d+\.(?:enorm|hnorm|final_layernorm))\._extra_state$")

_LOCAL_NORM = re.compile(r"pre_mlp_layernorm\.(weight|bias)")
_TE_NORM = re.compile(r"mlp\.linear_fc1\.layer_norm_(weight|bias)")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias|_extra_state)")
_TE_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.(?:(weight|bias)(\d+)|(_extra_state)(\d*))")


def _split(key: str) -> Optional[tuple[str, str, str]]:
    """(text before the layer, the layer prefix, the rest), or None outside transformer layers."""
    m = _LAYER.search(key)
    if m is None:
        return None
    return key[:m.start()], m.group(1), key[m.end():]


def moe_layers(keys: Iterable[str]) -> frozenset[str]:
    """Layer prefixes (``decoder.layers.3.``, ``mtp.layers.0.transformer_layer.``) that hold a
    MoE block (a router) among ``keys``; every other layer of those keys is dense."""
    found = set()
    for key in keys:
        parts = _split(key)
        if parts and parts[2].startswith("mlp.router."):
            found.add(parts[1])
    return frozenset(found)


def local_to_te(key: str, moe: Container[str]) -> str:
    """The TE name of local ``key``; ``moe`` holds the MoE layer prefixes (:func:`moe_layers`)."""
    parts = _split(key)
    if parts is None:
        return key
    head, layer, rest = parts
    m = _LOCAL_NORM.fullmatch(rest)
    if m and layer not in moe:
        return f"{head}{layer}mlp.linear_fc1.layer_norm_{m.group(1)}"
    m = _LOCAL_EXPERT.fullmatch(rest)
    if m:
        expert, linear, leaf = int(m.group(1)), m.group(2), m.group(3)
        suffix = (expert or "") if leaf == "_extra_state" else expert
        return f"{head}{layer}mlp.experts.{linear}.{leaf}{suffix}"
    return key


def te_to_local(key: str) -> Optional[str]:
    """The local name of TE ``key``, or None for TE-only extra state (nothing to load it from or
    into locally). A local key maps to itself."""
    parts = _split(key)
    if parts is None:
        return None if _TE_ONLY_OUTSIDE.search(key) else key
    head, layer, rest = parts
    if rest.endswith("._extra_state") and rest[:-len("._extra_state")] in (*_TE_ONLY_IN_LAYER, _MOE_NORM):
        return None
    m = _TE_NORM.fullmatch(rest)
    if m:
        return f"{head}{layer}pre_mlp_layernorm.{m.group(1)}"
    m = _TE_EXPERT.fullmatch(rest)
    if m:
        linear = m.group(1)
        leaf, expert = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
        return f"{head}{layer}mlp.experts.local_experts.{int(expert or 0)}.{linear}.{leaf}"
    return key


def te_only_keys(local_keys: Iterable[str]) -> list[str]:
    """The extra-state keys a TE model has beyond its local twin's (model keys, not optimizer
    keys): one per TE norm (input, q/kv, MoE pre-MLP, final, MTP enorm/hnorm/final) and per
    MLA down-projection, derived from the local keys of those modules' weights."""
    keys = list(local_keys)
    moe = moe_layers(keys)
    out = []
    for key in keys:
        if not key.endswith(".weight"):
            continue
        module = key[:-len(".weight")]
        parts = _split(key)
        if parts is None:
            if _TE_ONLY_OUTSIDE.search(module + "._extra_state"):
                out.append(module + "._extra_state")
            continue
        _, layer, rest = parts
        name = rest[:-len(".weight")]
        if name in _TE_ONLY_IN_LAYER or (name == _MOE_NORM and layer in moe):
            out.append(module + "._extra_state")
    return out


def te_keys(local_keys: Iterable[str]) -> list[str]:
    """The keys of the TE model whose local twin has ``local_keys`` (model keys)."""
    keys = list(local_keys)
    moe = moe_layers(keys)
    return [local_to_te(k, moe) for k in keys] + te_only_keys(keys)


def convert(key: str, src: str, dst: str, moe: Container[str]) -> Optional[str]:
    """``key`` in backend ``src``'s naming -> backend ``dst``'s (None: ``dst`` has no such
    tensor)."""
    for b in (src, dst):
        if b not in BACKENDS:
            raise ValueError(f"unknown layer backend {b!r} (expected one of {BACKENDS})")
    if src == dst:
        return key
    return local_to_te(key, moe) if dst == TE else te_to_local(key)


def backend_of_keys(keys: Iterable[str]) -> str:
    """``te`` when any key is a TE-only name (fused norm, TE extra state, grouped experts),
    else ``local``. Checkpoint keys may carry a ``/shard_...`` suffix (ShardedObjects)."""
    for key in keys:
        if te_to_local(key.split("/", 1)[0]) != key.split("/", 1)[0]:
            return TE
    return LOCAL


def model_backend(modules) -> str:
    """``te`` when any of ``modules`` (model chunks) contains a Transformer Engine layer."""
    for chunk in modules:
        for m in chunk.modules():
            if type(m).__module__.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine")):
                return TE
    return LOCAL


def checkpoint_backend(path: str, common: Optional[dict] = None) -> str:
    """The backend whose naming a megatron dist checkpoint uses: recorded in its common state
    (``layer_backend``, written since this was added), else told from its stored keys."""
    if common is None:
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(path)
    if common.get(COMMON_KEY) in BACKENDS:
        return common[COMMON_KEY]
    from torch.distributed.checkpoint import FileSystemReader

    return backend_of_keys(FileSystemReader(path).read_metadata().state_dict_metadata)


def adapt_to_checkpoint(sharded_sd: dict, model: str, checkpoint: str) -> Callable[[dict], dict]:
    """Make a sharded state dict of a ``model``-backend model load from a checkpoint in
    ``checkpoint`` naming: every ShardedTensor / factory / ShardedObject key (model chunks and
    optimizer state alike) is renamed in place, and entries the checkpoint cannot hold (TE-only
    extra state when a TE model loads a local checkpoint) are taken out. Returns ``restore``:
    ``restore(loaded)`` puts those entries' current values back into what
    ``dist_checkpointing.load`` returned, so a strict ``load_state_dict`` sees every key (the
    TE modules keep their fresh FP8 metadata)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if model == checkpoint:
        return lambda loaded: loaded
    found: list[tuple[tuple, dict, object, ShardedBase]] = []

    def walk(node, path):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in list(items):
            if isinstance(v, ShardedBase):
                found.append((path + (k,), node, k, v))
            elif isinstance(v, (dict, list)):
                walk(v, path + (k,))

    walk(sharded_sd, ())
    moe = moe_layers(sh.key for *_, sh in found)
    dropped, renamed = [], set()
    for path, parent, k, sh in found:
        new = convert(sh.key, model, checkpoint, moe)
        if new is None:
            if not isinstance(parent, dict):
                raise TypeError(f"{sh.key}: cannot drop an entry of a list at {path}")
            del parent[k]
            dropped.append((path, sh.data))
        elif id(sh) not in renamed:
            sh.key = new
            renamed.add(id(sh))

    def restore(loaded: dict) -> dict:
        for path, data in dropped:
            node = loaded
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = data
        return loaded

    return restore
