"""Local <-> Transformer Engine tensor names (``checkpointing/backend_keys.py``).

TE cannot be built here, so the TE key set is derived from the spec structure (``specs.py`` +
megatron-core 0.19.2's TE modules) and checked on every key of the tiny model's local state
dict, sharded state dict and checkpoint, and on the full GLM-5 naming (3 dense + 75 MoE layers,
256 experts, MTP): the round trip is the identity, the TE names of each renamed family are the
expected ones, and checkpoints cross backends through ``checkpointing.state.load`` and the HF
export.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from checkpointing import backend_keys as bk
from checkpointing.backend_keys import LOCAL, TE

TE_ONLY_IN_LAYER = ["input_layernorm._extra_state", "self_attention.q_layernorm._extra_state",
                    "self_attention.kv_layernorm._extra_state",
                    "self_attention.linear_q_down_proj._extra_state",
                    "self_attention.linear_kv_down_proj._extra_state"]


def _cfg(name: str):
    from model_providers.glm5.model.config import GLM5Config

    raw = OmegaConf.load(f"conf/model/{name}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GLM5Config), raw))


def _tiny_model(seed: int = 0):
    from model_providers.glm5.hf.evaluate import build_eval_model
    from parallel.config import ParallelConfig

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model,), _ = build_eval_model(_cfg("glm5_tiny"), ParallelConfig(), "dense", mtp_num_steps=3)
    with torch.no_grad():  # every weight seed-dependent, norms away from 1
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape) * (0.1 if "norm" in name else 0.01))
    return model


@pytest.fixture(scope="module")
def tiny(one_rank):
    return _tiny_model()


@pytest.fixture(scope="module")
def key_spaces(tiny):
    """The tiny local model's keys: module state dict, sharded-state-dict keys, checkpoint
    (global) keys."""
    sharded = tiny.sharded_state_dict()
    return {"state_dict": list(tiny.state_dict()), "sharded": list(sharded),
            "checkpoint": list(dict.fromkeys(v.key for v in sharded.values()))}


def _glm5_744b_keys(tiny_keys: list[str]) -> list[str]:
    """glm5_744b's local state-dict keys: the tiny model's dense layer (0) and MoE layer (1) as
    templates for its 3 dense + 75 MoE layers, 256 experts per MoE layer (the names depend only
    on the layer kinds and counts: same specs, same modules)."""
    cfg = _cfg("glm5_744b")
    dense = [k[len("decoder.layers.0."):] for k in tiny_keys if k.startswith("decoder.layers.0.")]
    moe = [k[len("decoder.layers.1."):] for k in tiny_keys if k.startswith("decoder.layers.1.")]

    def experts(suffixes):
        out = []
        for s in suffixes:
            m = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(.+)", s)
            if m is None:
                out.append(s)
            elif m.group(1) == "0":
                out += [f"mlp.experts.local_experts.{e}.{m.group(2)}" for e in range(cfg.num_experts)]
        return out

    moe = experts(moe)
    keys = [k for k in tiny_keys if not k.startswith(("decoder.layers.", "mtp.layers.0.mtp_model_layer."))]
    for i in range(cfg.num_layers):
        keys += [f"decoder.layers.{i}.{s}" for s in (dense if i < cfg.first_k_dense else moe)]
    keys += [f"mtp.layers.0.mtp_model_layer.{s}" for s in moe]  # MTP's layer is the last layer's kind
    return keys


# --- the map on every key -------------------------------------------------------------------------


@pytest.mark.parametrize("space", ["state_dict", "sharded", "checkpoint"])
def test_local_to_te_to_local_is_the_identity_on_every_tiny_key(key_spaces, space):
    keys = key_spaces[space]
    moe = bk.moe_layers(keys)
    # the MTP layer: megatron 0.19's module name; its checkpoint keys keep 0.16's
    mtp = "mtp.layers.0.transformer_layer." if space == "checkpoint" else "mtp.layers.0.mtp_model_layer."
    assert moe == {"decoder.layers.1.", "decoder.layers.2.", "decoder.layers.3.", mtp}
    for k in keys:
        assert bk.te_to_local(bk.local_to_te(k, moe)) == k, k
        assert bk.te_to_local(k) == k, k  # local names are fixed points: either naming normalises


@pytest.mark.parametrize("space", ["state_dict", "sharded", "checkpoint"])
def test_te_keys_map_back_to_exactly_the_local_keys(key_spaces, space):
    keys = key_spaces[space]
    te = bk.te_keys(keys)
    assert len(set(te)) == len(te), "two local keys got one TE name"
    assert {bk.te_to_local(k) for k in te} - {None} == set(keys)
    assert [k for k in te if bk.te_to_local(k) is None] == bk.te_only_keys(keys)
    assert bk.backend_of_keys(keys) == LOCAL and bk.backend_of_keys(te) == TE


def test_glm5_744b_naming_round_trips(key_spaces):
    keys = _glm5_744b_keys(key_spaces["state_dict"])
    moe = bk.moe_layers(keys)
    assert len(moe) == 76  # 75 MoE decoder layers + the MTP layer
    te = bk.te_keys(keys)
    assert len(set(te)) == len(te)
    assert {bk.te_to_local(k) for k in te} - {None} == set(keys)
    assert all(bk.te_to_local(bk.local_to_te(k, moe)) == k for k in keys)
    assert sorted(k for k in te if "layer_norm_weight" in k) == [
        f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight" for i in range(3)]
    assert [k for k in te if k.endswith("pre_mlp_layernorm.weight")] == [
        f"decoder.layers.{i}.pre_mlp_layernorm.weight" for i in range(3, 78)] + [
        "mtp.layers.0.mtp_model_layer.pre_mlp_layernorm.weight"]
    assert bk.local_to_te("decoder.layers.77.mlp.experts.local_experts.255.linear_fc2.weight", moe) == \
        "decoder.layers.77.mlp.experts.linear_fc2.weight255"


# --- one explicit family each ---------------------------------------------------------------------


def test_dense_pre_mlp_norm_is_fused_into_fc1(key_spaces):
    for space in ("state_dict", "sharded", "checkpoint"):
        te = bk.te_keys(key_spaces[space])
        assert [k for k in te if "layer_norm_" in k] == ["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"]
        assert not [k for k in te if k.startswith("decoder.layers.0.pre_mlp_layernorm")]
    moe = bk.moe_layers(key_spaces["checkpoint"])
    assert bk.local_to_te("decoder.layers.0.pre_mlp_layernorm.weight", moe) == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert bk.te_to_local("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    # the shared expert's fc1 and the dense fc1's own weight keep their names
    assert bk.te_to_local("decoder.layers.1.mlp.shared_experts.linear_fc1.weight") == \
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"
    assert bk.local_to_te("decoder.layers.0.mlp.linear_fc1.weight", moe) == "decoder.layers.0.mlp.linear_fc1.weight"


def test_moe_and_mtp_pre_mlp_norms_stay_separate(key_spaces):
    te = set(bk.te_keys(key_spaces["state_dict"]))
    for layer in ("decoder.layers.1.", "decoder.layers.2.", "decoder.layers.3.",
                  "mtp.layers.0.mtp_model_layer."):
        assert {layer + "pre_mlp_layernorm.weight", layer + "pre_mlp_layernorm._extra_state"} <= te
        assert layer + "mlp.linear_fc1.layer_norm_weight" not in te
    # a model without MoE (every layer dense, MTP's too): every pre-MLP norm fuses
    assert bk.local_to_te("mtp.layers.0.mtp_model_layer.pre_mlp_layernorm.weight", frozenset()) == \
        "mtp.layers.0.mtp_model_layer.mlp.linear_fc1.layer_norm_weight"


def test_mla_norms_keep_their_names(key_spaces):
    moe = bk.moe_layers(key_spaces["state_dict"])
    for key in ("decoder.layers.0.self_attention.q_layernorm.weight",
                "decoder.layers.3.self_attention.kv_layernorm.weight",
                "mtp.layers.0.mtp_model_layer.input_layernorm.weight"):
        assert key in key_spaces["state_dict"]
        assert bk.local_to_te(key, moe) == key


def test_grouped_experts_in_state_dicts_and_shared_checkpoint_keys(key_spaces):
    moe = bk.moe_layers(key_spaces["state_dict"])
    pairs = {"decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight":
             "decoder.layers.1.mlp.experts.linear_fc1.weight0",
             "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight":
             "decoder.layers.3.mlp.experts.linear_fc2.weight7",
             "mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.5.linear_fc1.weight":
             "mtp.layers.0.mtp_model_layer.mlp.experts.linear_fc1.weight5",
             "decoder.layers.2.mlp.experts.local_experts.0.linear_fc1._extra_state":
             "decoder.layers.2.mlp.experts.linear_fc1._extra_state",
             "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2._extra_state":
             "decoder.layers.2.mlp.experts.linear_fc2._extra_state3"}
    for local, te in pairs.items():
        assert local in key_spaces["state_dict"]
        assert bk.local_to_te(local, moe) == te and bk.te_to_local(te) == local
    # megatron writes both as one expert-axis tensor: checkpoint keys are not renamed
    for key in ("decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
                "decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state"):
        assert key in key_spaces["checkpoint"]
        assert bk.local_to_te(key, moe) == key and bk.te_to_local(key) == key


def test_te_only_extra_state(key_spaces):
    got = set(bk.te_only_keys(key_spaces["checkpoint"]))
    want = {"decoder.final_layernorm._extra_state", "mtp.layers.0.enorm._extra_state",
            "mtp.layers.0.hnorm._extra_state", "mtp.layers.0.final_layernorm._extra_state"}
    for layer in ("decoder.layers.0.", "decoder.layers.1.", "decoder.layers.2.", "decoder.layers.3.",
                  "mtp.layers.0.transformer_layer."):
        want |= {layer + s for s in TE_ONLY_IN_LAYER}
        if layer != "decoder.layers.0.":
            want.add(layer + "pre_mlp_layernorm._extra_state")
    assert got == want
    assert all(bk.te_to_local(k) is None for k in want)
    # extra state both backends have keeps its name
    for key in ("decoder.layers.0.mlp.linear_fc1._extra_state", "mtp.layers.0.eh_proj._extra_state",
                "decoder.layers.1.self_attention.linear_proj._extra_state"):
        assert key in key_spaces["checkpoint"] and bk.te_to_local(key) == key


def test_prefixed_optimizer_keys(key_spaces):
    moe = bk.moe_layers(key_spaces["checkpoint"])
    assert bk.local_to_te("optimizer.state.exp_avg.decoder.layers.0.pre_mlp_layernorm.weight", moe) == \
        "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert bk.local_to_te("optimizer.state.exp_avg.decoder.layers.2.pre_mlp_layernorm.weight", moe) == \
        "optimizer.state.exp_avg.decoder.layers.2.pre_mlp_layernorm.weight"
    assert bk.te_to_local("optimizer.state.fp32_param.decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "optimizer.state.fp32_param.decoder.layers.0.pre_mlp_layernorm.weight"


def test_hf_names_accept_te_naming():
    from model_providers.glm5.hf.mapping import hf_names

    assert hf_names("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", 4) == \
        hf_names("decoder.layers.0.pre_mlp_layernorm.weight", 4) == ("model.layers.0.post_attention_layernorm.weight",)
    assert hf_names("decoder.layers.2.mlp.experts.linear_fc1.weight3", 4) == \
        ("model.layers.2.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight")


def test_model_backend_sees_te_modules(tiny):
    assert bk.model_backend([tiny]) == LOCAL

    class TELayer(torch.nn.Module):
        pass

    TELayer.__module__ = "megatron.core.extensions.transformer_engine"
    assert bk.model_backend([torch.nn.Sequential(torch.nn.Linear(2, 2), TELayer())]) == TE


# --- checkpoints across backends ------------------------------------------------------------------


def _save(sharded: dict, path, backend: str | None) -> None:
    """A dist checkpoint of ``sharded`` with the tiny model's config (what export reads) and,
    unless None, the recorded backend."""
    from megatron.core import dist_checkpointing

    from model_providers.glm5.hf.convert import COMMON_MODEL
    from parallel import megatron_compat

    common = {COMMON_MODEL: json.dumps(dataclasses.asdict(_cfg("glm5_tiny")))}
    if backend is not None:
        common[bk.COMMON_KEY] = backend
    megatron_compat.install()  # in-process write results, as a run has
    path.mkdir()
    dist_checkpointing.save({"model0": sharded, **common}, str(path))


def _te_named_checkpoint(model, path, record: bool = True):
    """What a TE run writes for ``model``'s weights: its keys in TE naming, plus TE-only extra
    state (checkpoint keys renamed by the map under test; ``record=False``: an older checkpoint
    without the backend entry)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sharded = model.sharded_state_dict()
    bk.adapt_to_checkpoint(sharded, LOCAL, TE)  # a local request in TE naming, renamed in place
    for key in bk.te_only_keys(v.key for v in sharded.values()):
        sharded[key] = ShardedObject(key, torch.empty(0, dtype=torch.uint8), (1,), (0,), replica_id=0)
    _save(sharded, path, TE if record else None)


def test_checkpoint_written_by_te_loads_into_a_local_model(tiny, tmp_path):
    from checkpointing import state as checkpoint
    _te_named_checkpoint(tiny, tmp_path / "te")
    assert bk.checkpoint_backend(str(tmp_path / "te")) == TE
    fresh = _tiny_model(seed=1)
    assert not torch.equal(fresh.decoder.layers[0].pre_mlp_layernorm.weight,
                           tiny.decoder.layers[0].pre_mlp_layernorm.weight)
    checkpoint.load(str(tmp_path / "te"), [fresh])
    want, got = tiny.state_dict(), fresh.state_dict()
    for k, v in want.items():
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state"):
            assert torch.equal(v, got[k]), k


def test_backend_is_told_from_the_keys_when_not_recorded(tiny, tmp_path):
    _te_named_checkpoint(tiny, tmp_path / "te", record=False)
    assert bk.checkpoint_backend(str(tmp_path / "te")) == TE
    local = tiny.sharded_state_dict()
    _save(local, tmp_path / "local", None)
    assert bk.checkpoint_backend(str(tmp_path / "local")) == LOCAL


def test_te_model_request_loads_from_a_local_checkpoint(tiny, tmp_path):
    """A TE model's sharded state dict (the local model's, renamed to TE names and given TE-only
    extra state) loads from a local checkpoint: renamed back, the TE-only entries left out of the
    load and handed back with their own values."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    _save(tiny.sharded_state_dict(), tmp_path / "local", LOCAL)
    fresh = _tiny_model(seed=1)
    request = fresh.sharded_state_dict()
    te_only = bk.te_only_keys(v.key for v in request.values())
    bk.adapt_to_checkpoint(request, LOCAL, TE)  # TE's checkpoint keys, and its state-dict name:
    request["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] = \
        request.pop("decoder.layers.0.pre_mlp_layernorm.weight")
    marker = torch.tensor([7], dtype=torch.uint8)
    for key in te_only:
        request[key] = ShardedObject(key, marker, (1,), (0,), replica_id=0)
    sd = {"model0": request}
    restore = bk.adapt_to_checkpoint(sd, TE, bk.checkpoint_backend(str(tmp_path / "local")))
    assert request["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"].key == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    loaded = restore(dist_checkpointing.load(sd, str(tmp_path / "local")))["model0"]
    assert torch.equal(loaded["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"],
                       tiny.decoder.layers[0].pre_mlp_layernorm.weight)
    assert torch.equal(loaded["decoder.layers.2.pre_mlp_layernorm.weight"],
                       tiny.decoder.layers[2].pre_mlp_layernorm.weight)
    assert loaded["decoder.layers.0.input_layernorm._extra_state"] is marker
    assert loaded["mtp.layers.0.enorm._extra_state"] is marker


def test_hf_export_of_a_te_checkpoint_equals_the_local_one(tiny, tmp_path):
    from safetensors.torch import load_file

    from model_providers.glm5.hf.convert import export_hf

    _te_named_checkpoint(tiny, tmp_path / "te")
    _save(tiny.sharded_state_dict(), tmp_path / "local", LOCAL)
    outs = {}
    for name in ("te", "local"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export_hf(str(tmp_path / name), str(tmp_path / f"hf_{name}"))
        outs[name] = load_file(str(tmp_path / f"hf_{name}" / "model.safetensors"))
    assert outs["te"].keys() == outs["local"].keys()
    assert all(torch.equal(outs["te"][k], outs["local"][k]) for k in outs["local"])
    assert torch.equal(outs["te"]["model.layers.0.post_attention_layernorm.weight"],
                       tiny.decoder.layers[0].pre_mlp_layernorm.weight)
