"""Megatron GLM-5 parameter names <-> Hugging Face ``GlmMoeDsaForCausalLM`` tensor names, and
per-tensor safetensors reading / sharded writing.

Megatron names are the 1-rank state-dict names (``local_experts.<i>`` is global expert i). A
megatron tensor is one HF tensor, or (the SwiGLU ``linear_fc1``) HF ``gate_proj`` and
``up_proj`` stacked along rows. Layouts need no other transform: megatron's MLA splits
``linear_kv_down_proj`` into [latent ; rope] and ``linear_kv_up_proj`` per head into
[k_nope ; v] exactly as HF's ``kv_a_proj_with_mqa`` / ``kv_b_proj``, its rope de-interleaves like
``apply_rotary_pos_emb_interleave``, and its MTP layer concatenates [embedding ; hidden] before
``eh_proj`` as GLM-5's released MTP module (layer ``num_hidden_layers``) does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Iterable

import torch

from checkpointing import backend_keys
from model_providers.glm5.hf.paths import HFPathError

#: megatron suffix inside a transformer layer -> HF suffix(es) inside ``model.layers.<i>.``
LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_a_layernorm.weight",),
    "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight",),
    "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight",),
    "self_attention.kv_layernorm.weight": ("self_attn.kv_a_layernorm.weight",),
    "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight",),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias",),
    "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_experts.gate_proj.weight",
                                             "mlp.shared_experts.up_proj.weight"),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_experts.down_proj.weight",),
}
for _t in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
    LAYER[f"self_attention.core_attention.indexer.{_t}"] = (f"self_attn.indexer.{_t}",)
#: megatron MTP-module suffix (outside its transformer layer) -> HF suffix in the MTP layer
MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
       "eh_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}
#: released checkpoints keep copies of the embedding and head inside the MTP layer
MTP_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight",
              "shared_head.head.weight": "lm_head.weight"}
TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
       "decoder.final_layernorm.weight": "model.norm.weight",
       "output_layer.weight": "lm_head.weight"}
#: megatron tensor -> its copy's suffix in the MTP layer
TOP_COPIES = {meg: copy for copy, main in MTP_COPIES.items() for meg, hf in TOP.items() if hf == main}
#: megatron tensors that stay fp32 whatever dtype the rest is converted to
FP32_TENSORS = ("mlp.router.weight", "mlp.router.expert_bias")
#: megatron tensors whose rows are the (padded) vocabulary
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")

_DECODER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
#: the MTP module's transformer layer: megatron 0.19's module name, and its checkpoint key (0.16's)
_MTP_LAYER = re.compile(r"mtp\.layers\.0\.(?:mtp_model|transformer)_layer\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
_HF_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _layer_names(prefix: str, suffix: str) -> tuple[str, ...]:
    m = _EXPERT.fullmatch(suffix)
    if m:
        e = f"{prefix}mlp.experts.{m.group(1)}."
        return (e + "gate_proj.weight", e + "up_proj.weight") if m.group(2) == "1" else (e + "down_proj.weight",)
    if suffix not in LAYER:
        raise KeyError(f"no Hugging Face mapping for megatron tensor suffix {suffix!r}")
    return tuple(prefix + s for s in LAYER[suffix])


def hf_names(name: str, num_layers: int) -> tuple[str, ...]:
    """HF tensors making up megatron tensor ``name`` (stacked along dim 0 when two); local or
    Transformer Engine naming (``backend_keys``: e.g. a dense layer's fused
    ``mlp.linear_fc1.layer_norm_weight`` is HF ``post_attention_layernorm.weight``)."""
    name = backend_keys.te_to_local(name) or name
    if name in TOP:
        return (TOP[name],)
    m = _DECODER.fullmatch(name)
    if m:
        return _layer_names(f"model.layers.{m.group(1)}.", m.group(2))
    m = _MTP_LAYER.fullmatch(name)
    if m:
        return _layer_names(f"model.layers.{num_layers}.", m.group(1))
    if name.startswith("mtp.layers.0.") and name[len("mtp.layers.0."):] in MTP:
        return (f"model.layers.{num_layers}.{MTP[name[len('mtp.layers.0.'):]]}",)
    raise KeyError(f"no Hugging Face mapping for megatron tensor {name!r}")


def group_of(name: str) -> str:
    """The layer a megatron tensor belongs to (conversion works one group at a time)."""
    m = _DECODER.fullmatch(name)
    if m:
        return f"decoder.layers.{m.group(1)}"
    return "mtp" if name.startswith("mtp.") else name


#: the dtypes GLM-5's weights are stored in (safetensors codes): an integer or other tensor
#: would be converted on import into numbers that are not the model's
WEIGHT_DTYPES = ("F32", "BF16", "F16")


class HFTensorError(HFPathError):
    """A stored tensor of a dtype or shape the model does not take."""


class HFReader:
    """Reads single tensors from an HF safetensors checkpoint (one shard or an index). Each read
    maps its shard only for that read, so nothing else of the model stays resident. Fused
    expert tensors (``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]) also
    answer per-expert names."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    self.where = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFPathError(f"{index} is not a readable safetensors index "
                                  f"({type(e).__name__}: {e})") from None
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            self.where = {k: "model.safetensors" for k in self._keys("model.safetensors")}
        else:
            raise HFPathError(f"no model.safetensors or model.safetensors.index.json in {path}")
        self._meta: dict = {}
        self.verify()

    def verify(self) -> None:
        """Open every shard once (safetensors checks that its header parses and its data covers
        the file) and check that it holds the tensors the index places in it: a missing,
        truncated or mismatched shard is named before any tensor is read."""
        by_shard: dict[str, set] = {}
        for name, shard in self.where.items():
            by_shard.setdefault(shard, set()).add(name)
        for shard, names in by_shard.items():
            absent = sorted(names - set(self._keys(shard)))
            if absent:
                raise HFPathError(f"{os.path.join(self.path, shard)} lacks {len(absent)} tensors "
                                  f"its index places there: {absent[:5]}")

    def _keys(self, shard: str) -> list[str]:
        from safetensors import safe_open

        with self._reading(shard):
            with safe_open(os.path.join(self.path, shard), "pt") as f:
                return list(f.keys())

    @contextlib.contextmanager
    def _reading(self, shard: str, tensor: str | None = None):
        """Names the shard (and tensor) in any error reading it."""
        from safetensors import SafetensorError

        try:
            yield
        except (SafetensorError, OSError) as e:
            what = f" (reading {tensor})" if tensor else ""
            path = os.path.join(self.path, shard)
            if isinstance(e, FileNotFoundError) and not os.path.exists(path):
                raise HFPathError(f"shard {path} is missing{what}") from None
            raise HFPathError(f"shard {path} is damaged or unreadable{what}: {e}") from None

    def has(self, name: str) -> bool:
        return name in self.where or self._fused(name) is not None

    def _fused(self, name: str):
        m = _HF_EXPERT.fullmatch(name)
        if not m:
            return None
        base, e, kind = m.group(1), int(m.group(2)), m.group(3)
        fused = f"{base}.{'down_proj' if kind == 'down' else 'gate_up_proj'}"
        return (fused, e, kind) if fused in self.where else None

    def _slice_info(self, name: str):
        if name not in self._meta:
            from safetensors import safe_open

            with self._reading(self.where[name], name), \
                    safe_open(os.path.join(self.path, self.where[name]), "pt") as f:
                s = f.get_slice(name)
                self._meta[name] = (s.get_dtype(), tuple(s.get_shape()))
        return self._meta[name]

    def dtype(self, name: str) -> torch.dtype:
        fused = self._fused(name) if name not in self.where else None
        code = self._slice_info(fused[0] if fused else name)[0]
        if code not in _DTYPES:
            raise HFTensorError(f"{name} in {self.path} is stored as {code}, not a weight dtype ({', '.join(WEIGHT_DTYPES)})")
        return _DTYPES[code]

    def shape(self, name: str) -> tuple:
        """The stored shape of ``name`` (a fused expert tensor's per-expert part for its names)."""
        fused = self._fused(name) if name not in self.where else None
        if not fused:
            return self._slice_info(name)[1]
        source, _, kind = fused
        _, rows, cols = self._slice_info(source)[1]
        return (rows, cols) if kind == "down" else (rows // 2, cols)

    def check_dtypes(self) -> None:
        """Every stored tensor in one of :data:`WEIGHT_DTYPES`, each shard's header read once (before
        any model is built or tensor read)."""
        by_shard: dict[str, list] = {}
        for name, shard in self.where.items():
            if name not in self._meta:
                by_shard.setdefault(shard, []).append(name)
        from safetensors import safe_open

        for shard, names in by_shard.items():
            with self._reading(shard), safe_open(os.path.join(self.path, shard), "pt") as f:
                for name in names:
                    s = f.get_slice(name)
                    self._meta[name] = (s.get_dtype(), tuple(s.get_shape()))
        bad = sorted((n, m[0]) for n, m in self._meta.items() if n in self.where and m[0] not in WEIGHT_DTYPES)
        if bad:
            shown = ", ".join(f"{n} ({code})" for n, code in bad[:5])
            raise HFTensorError(f"{len(bad)} tensors in {self.path} are not stored as a weight dtype "
                                f"({', '.join(WEIGHT_DTYPES)}): {shown}")

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        fused = self._fused(name) if name not in self.where else None
        source = fused[0] if fused else name
        if source not in self.where:
            raise KeyError(f"{name} not in {self.path}")
        with self._reading(self.where[source], name), \
                safe_open(os.path.join(self.path, self.where[source]), "pt") as f:
            if not fused:
                return f.get_tensor(name)
            _, e, kind = fused
            sl = f.get_slice(source)
            if kind == "down":
                return sl[e:e + 1][0]
            half = sl.get_shape()[1] // 2
            return (sl[e:e + 1, :half] if kind == "gate" else sl[e:e + 1, half:])[0]

    def rows_equal(self, a: str, b: str, block: int = 4096) -> bool:
        """Whether two stored 2-D tensors are equal, compared ``block`` rows at a time."""
        from safetensors import safe_open

        with self._reading(self.where[a], a), safe_open(os.path.join(self.path, self.where[a]), "pt") as fa:
            sa = fa.get_slice(a)
            with self._reading(self.where[b], b), \
                    safe_open(os.path.join(self.path, self.where[b]), "pt") as fb:  # each error names its own
                sb = fb.get_slice(b)
                if sa.get_shape() != sb.get_shape():
                    return False
                return all(torch.equal(sa[i:i + block], sb[i:i + block])
                           for i in range(0, sa.get_shape()[0], block))


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class ShardWriter:
    """Writes HF safetensors shards of at most ``max_bytes`` (one buffered at a time) and the
    ``model.safetensors.index.json``; shard names get their final ``-of-N`` at ``close``."""

    def __init__(self, out_dir: str, max_bytes: int = 5 * 2**30):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[list[str]] = []
        os.makedirs(out_dir, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = tensor.contiguous()
        self.size += nbytes

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            self.add(name, tensor)

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buffer:
            return
        save_file(self.buffer, os.path.join(self.out_dir, f"part-{len(self.files):05d}.tmp"),
                  metadata={"format": "pt"})
        self.files.append(sorted(self.buffer))
        self.buffer, self.size = {}, 0

    def close(self) -> dict:
        self.flush()
        n = len(self.files)
        weight_map, total = {}, 0
        for i, names in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f"part-{i:05d}.tmp"), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
            total += os.path.getsize(os.path.join(self.out_dir, final))
        if n > 1:
            with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        return weight_map
