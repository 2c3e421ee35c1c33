"""Import Hugging Face GLM-5 weights into a megatron dist checkpoint, and export one back.

Both directions go through the 1-rank megatron model built on the meta device (no memory): its
``sharded_state_dict()`` names every stored tensor, its global key, shape and chunking (the
SwiGLU factory, the per-expert axis), so the checkpoint is exactly what megatron itself would
write at one rank and loads, resharded, at any TP/PP/EP layout. Import reads one HF tensor at a
time and writes each megatron tensor as soon as it is converted; export reads one layer of the
checkpoint at a time and keeps at most one safetensors shard buffered.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
import zlib

import torch
from omegaconf import OmegaConf

from checkpointing import backend_keys

from checkpointing import dist_io

from model_providers.glm5.hf import paths as hf_paths
from model_providers.glm5.model.config import GLM5Config, PrecisionConfig, to_transformer_config
from model_providers.glm5.hf.config import PASSTHROUGH, glm5_from_hf, hf_from_glm5
from model_providers.glm5.hf.mapping import (
    FP32_TENSORS, MTP_COPIES, TOP_COPIES, VOCAB_ROWS, HFReader, HFTensorError, ShardWriter, group_of, hf_names)

MODEL_YAML = "glm5_model.yaml"  #: written next to an import: the GLM5Config (Hydra ``model``)
COMMON_MODEL = "glm5_model"  #: common-state key: the GLM5Config as JSON
COMMON_HF = "hf_config"  #: common-state key: the source HF config as JSON


class MissingWeightsError(KeyError):
    pass


def ensure_one_rank(seed: int = 1) -> None:
    """A 1-rank gloo group and megatron's model-parallel groups, unless already set up."""
    from megatron.core import parallel_state

    from parallel.config import ParallelConfig
    from parallel.initialize import DistEnv, initialize

    if parallel_state.model_parallel_is_initialized() and torch.distributed.is_initialized():
        return
    initialize(ParallelConfig(), seed=seed, env=DistEnv.one_process())


def meta_model(cfg: GLM5Config):
    """The whole model as one rank would build it, on the meta device (structure only)."""
    from megatron.core import parallel_state
    from parallel.config import ParallelConfig

    from model_providers.glm5.model.provider import build_model_chunks

    ensure_one_rank()
    if parallel_state.get_tensor_model_parallel_world_size() * \
            parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise RuntimeError("meta_model needs a 1-rank model-parallel setup")
    tcfg = to_transformer_config(cfg, ParallelConfig(), PrecisionConfig())
    tcfg.use_cpu_initialization, tcfg.perform_initialization = True, False
    tcfg.moe_grouped_gemm = False
    with torch.device("meta"):
        return build_model_chunks(cfg, tcfg, "local")[0]


def config_from_common(common: dict) -> GLM5Config:
    """The model config a checkpoint was written with: an import's JSON, or a training run's
    resolved ``config_yaml``."""
    if COMMON_MODEL in common:
        raw = json.loads(common[COMMON_MODEL])
    elif "config_yaml" in common:
        raw = OmegaConf.to_container(OmegaConf.create(common["config_yaml"]), resolve=True)["model"]
    else:
        raise hf_paths.HFPathError("the checkpoint's common state has neither an imported "
                                   f"model config ({COMMON_MODEL!r}) nor a run's 'config_yaml'")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GLM5Config), raw))


def init_tensor(name: str, shape, cfg: GLM5Config, seed: int = 1234) -> torch.Tensor:
    """megatron-style fresh init of one tensor: norms 1, biases 0, linears N(0, init_std)
    (output projections N(0, init_std / sqrt(2 * num_layers)))."""
    leaf = name.rsplit(".", 2)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith((".bias", "expert_bias")):
        return torch.zeros(shape)
    std = cfg.init_std
    if leaf[-2] in ("linear_proj", "linear_fc2"):
        std /= (2.0 * cfg.num_layers) ** 0.5
    gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _check_mtp_copies(reader: HFReader, cfg: GLM5Config) -> None:
    for copy, main in MTP_COPIES.items():
        name = f"model.layers.{cfg.num_layers}.{copy}"
        if reader.has(name) and reader.has(main):
            if not reader.rows_equal(name, main):
                warnings.warn(f"{name} differs from {main}; the MTP module shares the main one, "
                              "the copy is not imported")


def _check_sources(reader: HFReader, sources: dict, cfg: GLM5Config, hf_dir: str) -> list[str]:
    """Every megatron tensor has its HF tensors, every HF tensor is used; a wholly missing MTP
    module is allowed (returned: the megatron tensors to initialise instead)."""
    missing = {n: [h for h in hs if not reader.has(h)] for n, hs in sources.items()}
    missing = {n: hs for n, hs in missing.items() if hs}
    mtp = [n for n in sources if n.startswith("mtp.")]
    initialised = []
    if any(n in missing for n in mtp):
        if not all(n in missing for n in mtp):
            absent = sorted(h for n in mtp for h in missing.get(n, []))
            raise MissingWeightsError(f"the MTP module model.layers.{cfg.num_layers}.* in {hf_dir} "
                                      f"is incomplete; missing: {absent[:10]}")
        warnings.warn(f"{hf_dir} has no MTP module (model.layers.{cfg.num_layers}.*, e.g. a model "
                      f"saved by transformers); initialising it at random (init_std={cfg.init_std}) "
                      f"for mtp_num_steps={cfg.mtp_num_steps}. Its predictions start untrained.")
        initialised = mtp
    if any(n not in initialised for n in missing):
        listed = sorted(h for n, hs in missing.items() if n not in initialised for h in hs)
        raise MissingWeightsError(f"{len(listed)} tensors missing from {hf_dir}: {listed[:10]}")
    used = {h for n, hs in sources.items() if n not in initialised for h in hs}
    mtp_prefix = f"model.layers.{cfg.num_layers}."
    copies = {mtp_prefix + c for c in MTP_COPIES}
    skipped = [h for h in reader.where if h.startswith(mtp_prefix) and not cfg.mtp_num_steps]
    unused = [h for h in reader.where if h not in used and h not in copies and h not in skipped
              and "rotary_emb" not in h and not _is_fused_expert(h)]
    if unused:
        raise MissingWeightsError(f"{len(unused)} HF tensors have no megatron counterpart: {unused[:10]}")
    if skipped:
        warnings.warn(f"mtp_num_steps=0: the MTP module {mtp_prefix}* is not imported")
    elif cfg.mtp_num_steps and not initialised:
        _check_mtp_copies(reader, cfg)
    return initialised


def _check_shapes(reader: HFReader, sources: dict, shapes: dict, initialised: list) -> None:
    """Every megatron tensor's HF parts (concatenated along rows; the vocabulary rows padded)
    have its shape, from the shard headers: a mismatch is named before anything is written."""
    bad = []
    for name, expected in shapes.items():
        if name in initialised:
            continue
        parts = [reader.shape(h) for h in sources[name]]
        shape = parts[0] if len(parts) == 1 else (sum(p[0] for p in parts), *parts[0][1:])
        if any(tuple(p[1:]) != tuple(parts[0][1:]) for p in parts):
            shape = tuple(parts)
        elif name in VOCAB_ROWS and shape and shape[0] < expected[0]:
            shape = (expected[0], *shape[1:])
        if tuple(shape) != tuple(expected):
            stored = " + ".join(f"{h} {tuple(p)}" for h, p in zip(sources[name], parts))
            bad.append(f"{name} <- {stored}, expected {tuple(expected)}")
    if bad:
        raise HFTensorError(f"{len(bad)} tensors in {reader.path} do not have the shapes config.json gives: "
                            + "; ".join(bad[:3]))


def import_hf(hf_dir: str, out_dir: str, mtp_num_steps: int = 3, dtype: torch.dtype | None = None,
              seed: int = 1234, **training_fields) -> dict:
    """HF checkpoint -> megatron dist checkpoint at ``out_dir`` (absent or empty; staged and
    renamed, see ``hf_paths``). Tensors keep their stored dtype unless ``dtype`` is given (fp32
    router weights and expert bias always stay fp32). The folders, the config and every shard's
    header are checked before the model is built."""
    from transformers import GlmMoeDsaConfig

    hf_paths.check_hf_dir(hf_dir)
    hf_paths.check_output(out_dir, hf_dir)
    hf_cfg = GlmMoeDsaConfig.from_pretrained(hf_dir)
    cfg = glm5_from_hf(hf_cfg, mtp_num_steps=mtp_num_steps, **training_fields)
    reader = HFReader(hf_dir)
    reader.check_dtypes()
    sharded = meta_model(cfg).sharded_state_dict()
    chunks, objects = dist_io.plan_chunks(sharded)
    names = list(dict.fromkeys(c.name for c in chunks))
    shapes = {n: tuple(sharded[n].data.shape) for n in names}
    sources = {n: hf_names(n, cfg.num_layers) for n in names}
    initialised = _check_sources(reader, sources, cfg, hf_dir)
    _check_shapes(reader, sources, shapes, initialised)
    main_dtype = reader.dtype("model.embed_tokens.weight")
    stored = {n: main_dtype if n in initialised else reader.dtype(sources[n][0]) for n in names}
    dtypes = {n: cast_dtype(n, d, dtype) for n, d in stored.items()}

    def source(name: str) -> torch.Tensor:
        if name in initialised:
            return init_tensor(name, shapes[name], cfg, seed)
        parts = [reader.get(h) for h in sources[name]]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if name in VOCAB_ROWS and t.shape[0] < shapes[name][0]:
            t = torch.cat([t, t.new_zeros(shapes[name][0] - t.shape[0], *t.shape[1:])])
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name} <- {sources[name]}: shape {tuple(t.shape)}, expected {shapes[name]}")
        return t

    passthrough = {k: getattr(hf_cfg, k, None) for k in PASSTHROUGH}
    common = {COMMON_MODEL: json.dumps(dataclasses.asdict(cfg)),
              COMMON_HF: json.dumps(passthrough), "hf_source": str(hf_dir),
              backend_keys.COMMON_KEY: backend_keys.LOCAL}  # names of the local spec (meta_model)
    with hf_paths.staged_output(out_dir) as tmp:
        dist_io.save_lazily(tmp, chunks, objects, dtypes, source, common)
        with open(os.path.join(tmp, MODEL_YAML), "w") as f:  # the run's model.* settings
            f.write(OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg))))
    return {"checkpoint": out_dir, "tensors": len(names), "mtp_initialised": bool(initialised),
            "model_yaml": os.path.join(out_dir, MODEL_YAML)}


def cast_dtype(name: str, stored: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """The dtype to write megatron tensor ``name`` in: ``requested``, except that fp32 router
    tensors stay fp32 (HF keeps them fp32 in bf16 checkpoints too)."""
    if requested is None or (stored == torch.float32 and name.endswith(FP32_TENSORS)):
        return stored
    return requested


def _is_fused_expert(name: str) -> bool:
    return name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


def _hf_tensors(name: str, tensor: torch.Tensor, cfg: GLM5Config, dtype):
    """(HF name, tensor) pairs of one megatron tensor: vocab padding dropped, SwiGLU split."""
    hs = hf_names(name, cfg.num_layers)
    if name in VOCAB_ROWS:
        tensor = tensor[: cfg.vocab_size]
    tensor = tensor.to(cast_dtype(name, tensor.dtype, dtype))
    parts = [tensor] if len(hs) == 1 else tensor.chunk(len(hs), dim=0)
    return [(h, p.clone()) for h, p in zip(hs, parts)]


def export_hf(ckpt_dir: str, out_dir: str, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 * 2**30) -> dict:
    """megatron dist checkpoint (an import or a training run's, either layer backend) -> HF
    ``config.json`` + safetensors shards (GLM-5's released layout: experts one by one, the MTP
    module as layer ``num_layers`` with copies of embedding and head), one checkpoint layer in
    memory at a time. ``out_dir`` must be absent or empty; the result is staged and renamed
    (``hf_paths``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    hf_paths.check_checkpoint_dir(ckpt_dir)
    hf_paths.check_output(out_dir, ckpt_dir)
    dist_io.check_files(ckpt_dir)
    common = dist_io.load_common(ckpt_dir)
    cfg = config_from_common(common)
    stored = dist_io.stored_dtypes(ckpt_dir)
    sharded = {k: v for k, v in meta_model(cfg).sharded_state_dict().items()
               if not isinstance(v, ShardedObject)}
    # a Transformer Engine run's checkpoint names the dense layers' pre-MLP norm differently
    backend_keys.adapt_to_checkpoint(sharded, backend_keys.LOCAL,
                                     backend_keys.checkpoint_backend(ckpt_dir, common))
    groups: dict[str, list[str]] = {}
    for name in sharded:
        groups.setdefault(group_of(name), []).append(name)
    passthrough = json.loads(common.get(COMMON_HF, "{}"))
    main = str(dtype or stored["embedding.word_embeddings.weight"]).replace("torch.", "")
    hf_cfg = hf_from_glm5(cfg, passthrough, dtype=main)  # rejects an unexportable config first
    with hf_paths.staged_output(out_dir) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for names in groups.values():
            for name, tensor in dist_io.load_tensors(ckpt_dir, sharded, names, stored).items():
                writer.add_all(_hf_tensors(name, tensor, cfg, dtype))
        if cfg.mtp_num_steps:
            mtp = f"model.layers.{cfg.num_layers}."
            for name, tensor in dist_io.load_tensors(ckpt_dir, sharded, list(TOP_COPIES), stored).items():
                writer.add_all((mtp + TOP_COPIES[name], t) for _, t in _hf_tensors(name, tensor, cfg, dtype))
        weight_map = writer.close()
        hf_cfg.save_pretrained(tmp)
    return {"hf_dir": out_dir, "tensors": len(weight_map), "files": len(set(weight_map.values()))}
