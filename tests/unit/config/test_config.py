"""The typed Hydra config: composition, overrides, strictness, and every validation failing
before any process group exists, with a message naming the field and its value."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from data_pipeline.tokenizer import tokenizer_vocab_size
from model_providers.glm5.model.config import GLM5Config, check_model
from pretrain.config.schema import RunConfig, register, to_run_config
from pretrain.config.validation import ConfigError, check_run, plan_run

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CONF = os.path.join(REPO, "conf")

register()


def _compose(*overrides: str, config_dir: str = CONF):
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("config", overrides=list(overrides))


def _rc(*overrides: str) -> RunConfig:
    """One run without curriculum stages (their fields would override trainer/optimizer/...)."""
    return to_run_config(_compose("curriculum=none", *overrides))


def validate(rc: RunConfig, world_size: int):
    """The run's validation (raises ConfigError); the layout of its one stage."""
    stages = plan_run(rc, world_size)
    return check_run(stages[0].rc, world_size)[0]


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized(), "a previous test left a torch.distributed process group"
    yield
    assert not dist.is_initialized(), "config handling must not start torch.distributed"


# --- composition and overrides ----------------------------------------------------------------


def test_defaults_compose_to_the_tiny_run():
    rc = _rc()
    assert isinstance(rc, RunConfig)
    assert rc.model == GLM5Config()
    assert (rc.model.num_layers, rc.model.hidden_size, rc.model.num_experts) == (4, 128, 8)
    assert (rc.parallel.tp, rc.parallel.pp, rc.parallel.ep, rc.parallel.cp) == (1, 1, 1, 1)
    assert rc.precision.dtype == "fp32" and rc.precision.fp8 is None
    assert rc.trainer.steps == 60 and rc.trainer.seq_length == 128
    assert rc.trainer.run_dir == "runs/glm5-tiny"  # ${trainer.name} resolved
    assert rc.scheduler.style == "cosine" and rc.optimizer.lr == 0.003
    assert rc.logger.wandb.mode == "offline"
    layout = validate(rc, world_size=1)
    assert layout.dp == 1 and layout.layers_per_stage == (4,)


def test_overrides():
    rc = _rc("parallel.tp=2")
    assert rc.parallel.tp == 2 and rc.parallel.pp == 1

    rc = _rc("parallel=tp2_pp2", "model=glm5_744b", "trainer.steps=7", "trainer.name=big")
    assert (rc.parallel.tp, rc.parallel.pp, rc.parallel.sequence_parallel) == (2, 2, True)
    assert (rc.model.num_layers, rc.model.hidden_size, rc.model.num_experts) == (78, 6144, 256)
    assert rc.model.vocab_size == 154880 and rc.model.dsa.topk == 2048
    assert rc.trainer.steps == 7
    assert rc.trainer.run_dir == "runs/big"
    with pytest.raises(ConfigError, match=r"scheduler.decay_steps=7 must exceed scheduler.warmup_steps=10"):
        validate(rc, world_size=8)  # 7 steps cannot hold the default 10 warm-up steps
    rc.scheduler.warmup_steps = 2
    layout = validate(rc, world_size=8)
    assert layout.dp == 2 and layout.layers_per_stage == (39, 39)


@pytest.mark.parametrize(
    "override, key",
    [("model.hiden_size=3", "model.hiden_size"), ("parallel.foo=1", "parallel.foo")],
)
def test_unknown_key_override_is_rejected(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        _compose(override)
    assert key in str(e.value)


@pytest.mark.parametrize(
    "override, key, schema",
    [
        ("+parallel.foo=1", "parallel.foo", "ParallelConfig"),
        ("+model.dsa.topkk=8", "model.dsa.topkk", "DSAConfig"),
        ("+foo=1", "foo", "RunConfig"),
    ],
)
def test_force_added_unknown_key_is_rejected(override, key, schema):
    """Hydra's ``+`` adds the key even to a typed node; the run config then rejects it."""
    cfg = _compose(override)
    with pytest.raises(ConfigKeyError) as e:
        to_run_config(cfg)
    assert f"full_key: {key}" in str(e.value) and schema in str(e.value)


def test_misspelled_key_in_a_group_yaml_is_rejected(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "model" / "good.yaml").write_text("num_attention_heads: 8\n")
    (conf / "model" / "typo.yaml").write_text("num_attention_head: 8\n")
    assert to_run_config(_compose("model=good", config_dir=str(conf))).model.num_attention_heads == 8
    with pytest.raises(ConfigCompositionException) as e:
        _compose("model=typo", config_dir=str(conf))
    msg = str(e.value)
    assert "num_attention_head" in msg and "model.num_attention_head" in msg and "GLM5Config" in msg


# --- validation: fails before any process group, naming field and value ------------------------


def _invalid(rc: RunConfig, world_size: int = 1):
    with pytest.raises(ConfigError) as e:
        validate(rc, world_size)
    assert not dist.is_initialized()
    return e


def test_decay_steps_not_after_warmup():
    rc = _rc("scheduler.warmup_steps=10", "scheduler.decay_steps=10")
    e = _invalid(rc)
    assert isinstance(e.value, ConfigError)
    assert "scheduler.decay_steps=10" in str(e.value) and "scheduler.warmup_steps=10" in str(e.value)
    validate(_rc("scheduler.warmup_steps=10", "scheduler.decay_steps=11"), 1)


def test_min_lr_above_lr():
    e = _invalid(_rc("optimizer.lr=0.001", "optimizer.min_lr=0.002"))
    assert "optimizer.min_lr=0.002" in str(e.value) and "optimizer.lr=0.001" in str(e.value)


def test_unknown_scheduler_style():
    e = _invalid(_rc("scheduler.style=cosnie"))
    assert "scheduler.style='cosnie'" in str(e.value)


def test_vocab_smaller_than_tokenizer():
    vocab = tokenizer_vocab_size(_rc().data.tokenizer)
    assert vocab == 512
    e = _invalid(_rc("model.vocab_size=511"))
    assert "model.vocab_size=511" in str(e.value) and f"vocabulary ({vocab}" in str(e.value)
    validate(_rc("model.vocab_size=512"), 1)


def test_seq_length_beyond_max_positions():
    e = _invalid(_rc("trainer.seq_length=8192", "trainer.micro_batch_size=1", "trainer.global_batch_size=1"))
    assert isinstance(e.value, ConfigError)
    assert "8192" in str(e.value) and "model.max_position_embeddings=4096" in str(e.value)


def test_bad_dsa_mode():
    e = _invalid(_rc("model.dsa.mode=sparce"))
    assert "model.dsa.mode='sparce'" in str(e.value)


def test_ep_overlap_is_refused_with_the_dsa_warmup():
    """The warm-up's frozen forward lives in GLM5Model.forward, which megatron's combined 1F1B
    schedule does not call; the same layout with sparse DSA validates."""
    ep = ("parallel.ep=2", "parallel.pp=2", "parallel.vpp=2", "precision=bf16", "model.recompute=selective",
          "model.recompute_modules=[mla_up_proj]", "parallel.overlap_moe_expert_parallel_comm=true",
          "model.num_layers=4")
    e = _invalid(_rc(*ep, "model.dsa.mode=warmup"), 4)
    assert "parallel.overlap_moe_expert_parallel_comm=true cannot run with model.dsa.mode=warmup" in str(e.value)
    validate(_rc(*ep, "model.dsa.mode=sparse"), 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp8 runs where CUDA exists")
@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_blockwise", "mxfp8"])
def test_fp8_validates_for_planning_and_is_refused_at_launch_without_cuda(recipe):
    """A plan for a GPU cluster is made where there is none: the config validates; a run
    started here is refused before anything is built, naming the field and what is missing."""
    from pretrain.config.validation import check_machine

    rc = _rc(f"precision={recipe}")
    stages = plan_run(rc, 1)
    with pytest.raises(ConfigError) as e:
        check_machine(stages)
    assert f"precision.fp8={rc.precision.fp8} needs CUDA and Transformer Engine (this machine has no CUDA)" \
        in str(e.value)


def test_bad_world_size_for_layout():
    e = _invalid(_rc("parallel=tp2_pp2"), world_size=2)
    assert "world size 2" in str(e.value) and "parallel.tp*pp*cp = 2*2*1 = 4" in str(e.value)
    e = _invalid(_rc("parallel=ep4"), world_size=2)
    assert "world size 2" in str(e.value) and "parallel.ep*etp*pp = 4*1*1 = 4" in str(e.value)
    assert validate(_rc("parallel=tp2_pp2"), 4).dp == 1


def test_bad_wandb_mode():
    e = _invalid(_rc("logger.wandb.mode=onlin"))
    assert "logger.wandb.mode='onlin'" in str(e.value)


def test_check_model_directly():
    rc = _rc()
    bad = dataclasses.replace(rc.model, dsa=dataclasses.replace(rc.model.dsa, mode="nope"))
    assert check_model(bad, rc.precision, 128) == ["model.dsa.mode='nope' must be none, dense, warmup or sparse"]
    assert check_model(rc.model, rc.precision, 4097) == [
        "trainer.seq_length=4097 exceeds model.max_position_embeddings=4096"]
    assert check_model(rc.model, rc.precision, 4096) == []
    assert not dist.is_initialized()


def test_every_problem_is_listed_at_once():
    e = _invalid(_rc("optimizer.min_lr=1.0", "logger.wandb.mode=x", "model.vocab_size=8"))
    msg = str(e.value)
    assert "optimizer.min_lr=1.0" in msg and "logger.wandb.mode='x'" in msg and "model.vocab_size=8" in msg


# --- the entry point ---------------------------------------------------------------------------


def test_train_entry_point_rejects_bad_layout_before_creating_the_run_dir(tmp_path):
    run_dir = tmp_path / "x"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("SLURM_")}
    env["WANDB_MODE"] = "disabled"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.train", "parallel.tp=3", f"trainer.run_dir={run_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert "world size 1 is not divisible by parallel.tp*pp*cp = 3*1*1 = 3" in out, out[-2000:]
    assert "model.num_attention_heads=4 is not divisible by parallel.tp=3" in out
    assert not run_dir.exists()
    assert elapsed < 30, f"took {elapsed:.1f}s to reject the config"


def test_recompute_options_are_checked_and_reach_megatron():
    from model_providers.glm5.model.config import PrecisionConfig, to_transformer_config
    from parallel.config import ParallelConfig

    assert check_model(GLM5Config(recompute="partial"), PrecisionConfig(), 128) == [
        "model.recompute='partial' must be null, selective or full"]
    [problem] = check_model(GLM5Config(recompute="selective", recompute_modules=["mla_up_proj", "attn"]),
                            PrecisionConfig(), 128)
    assert problem.startswith("model.recompute_modules=['mla_up_proj', 'attn']: must be a non-empty subset of")
    sel = to_transformer_config(GLM5Config(recompute="selective"), ParallelConfig(), PrecisionConfig())
    assert (sel.recompute_granularity, sel.recompute_modules) == ("selective", ["mla_up_proj", "moe"])
    full = to_transformer_config(GLM5Config(recompute="full"), ParallelConfig(), PrecisionConfig())
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert to_transformer_config(GLM5Config(), ParallelConfig(), PrecisionConfig()).recompute_granularity is None


# --- RoPE scaling ------------------------------------------------------------------------------

YARN = ("model.rope_type=yarn", "model.yarn.factor=4", "model.yarn.original_max_position_embeddings=1024")


def test_yarn_reaches_megatron_and_the_indexer():
    from model_providers.glm5.model.config import PrecisionConfig, YarnConfig, to_transformer_config
    from model_providers.glm5.model.dsa.indexer import mla_yarn
    from parallel.config import ParallelConfig

    rc = _rc(*YARN, "model.yarn.beta_fast=16", "model.yarn.beta_slow=2", "model.yarn.mscale=0.707",
             "model.yarn.mscale_all_dim=0.707")
    validate(rc, 1)
    t = to_transformer_config(rc.model, ParallelConfig(), PrecisionConfig())
    assert (t.rope_type, t.rotary_base, t.rotary_scaling_factor, t.original_max_position_embeddings,
            t.beta_fast, t.beta_slow, t.mscale, t.mscale_all_dim) == ("yarn", 1e6, 4.0, 1024, 16.0, 2.0,
                                                                      0.707, 0.707)
    assert mla_yarn(t) == rc.model.yarn == YarnConfig(4.0, 1024, 16.0, 2.0, 0.707, 0.707)
    # plain RoPE ignores model.yarn: megatron's MLA would scale its softmax by
    # yarn_mscale(rotary_scaling_factor, mscale_all_dim)^2 whatever the rope_type
    plain = to_transformer_config(dataclasses.replace(rc.model, rope_type="rope"), ParallelConfig(),
                                  PrecisionConfig())
    assert (plain.rope_type, plain.rotary_base, plain.rotary_scaling_factor) == ("rope", 1e6, 1.0)
    assert mla_yarn(plain) is None
    validate(_rc("model.yarn.factor=0.5", "model.yarn.beta_fast=0"), 1)  # unused, so not checked


@pytest.mark.parametrize("overrides, message", [
    (["model.rope_type=ntk"], "model.rope_type='ntk' must be rope or yarn"),
    (["model.rope_type=yarn"], "model.yarn.factor=1.0 must be > 1 with model.rope_type=yarn"),
    ([*YARN, "model.yarn.original_max_position_embeddings=0"],
     "model.yarn.original_max_position_embeddings=0 must be > 0"),
    ([*YARN, "model.yarn.beta_fast=1"],
     "model.yarn.beta_fast=1.0 and beta_slow=1.0 must satisfy beta_fast > beta_slow > 0"),
    ([*YARN, "model.yarn.beta_fast=4", "model.yarn.beta_slow=0"],
     "model.yarn.beta_fast=4.0 and beta_slow=0.0 must satisfy beta_fast > beta_slow > 0"),
    ([*YARN, "model.yarn.mscale_all_dim=-0.1"],
     "model.yarn.mscale=1.0 and mscale_all_dim=-0.1 must be >= 0"),
])
def test_bad_rope_scaling(overrides, message):
    e = _invalid(_rc(*overrides))
    assert isinstance(e.value, ConfigError) and message in str(e.value)


def test_fp8_with_local_layers_is_an_error():
    """The local spec under megatron's FP8 context is a no-op: a run would silently train in
    bf16 (on any machine, so it is a config error, not a machine one)."""
    e = _invalid(_rc("precision=fp8_blockwise", "model.layer_backend=local"))
    assert "precision.fp8=blockwise needs Transformer Engine layers" in str(e.value)
    assert "model.layer_backend='local'" in str(e.value)


@pytest.mark.parametrize("have_te", [True, False])
def test_fp8_with_cuda_needs_transformer_engine_at_launch(monkeypatch, have_te):
    """With CUDA, ``auto`` layers and no transformer_engine the run is refused when it starts."""
    import importlib.util

    from pretrain.config.validation import check_machine

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if have_te else None) if name == "transformer_engine"
                        else find_spec(name, *a))
    stages = plan_run(_rc("precision=fp8_blockwise"), 1)
    if have_te:
        check_machine(stages)
        return
    with pytest.raises(ConfigError, match="precision.fp8=blockwise needs CUDA and Transformer Engine$"):
        check_machine(stages)


def test_keep_last_and_the_run_name_are_checked():
    # a number out of range is named alone (pretrain/config/numbers.py), before the other checks
    assert _invalid(_rc("checkpoint.keep_last=-3", "trainer.name=")).value.problems == [
        "checkpoint.keep_last=-3 must be >= 0 (0: keep all)"]
    assert "trainer.name='' is empty" in str(_invalid(_rc("trainer.name=")).value)


def test_a_fresh_start_never_trains_over_another_runs_checkpoints(tmp_path):
    from tests.support.checkpoints import fake_checkpoint

    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir / "checkpoints", 4)
    e = _invalid(_rc(f"trainer.run_dir={run_dir}", "checkpoint.resume=false"))
    assert (f"checkpoint.resume=false: trainer.run_dir={run_dir} holds checkpoints (iter_0000004, latest in "
            f"{run_dir}/checkpoints) that a fresh run would overwrite; start the run in another folder "
            f"(trainer.name=NEW or trainer.run_dir=PATH)") in str(e.value)
    validate(_rc(f"trainer.run_dir={tmp_path / 'new'}", "checkpoint.resume=false"), 1)
    validate(_rc(f"trainer.run_dir={run_dir}"), 1)  # resuming them is what the folder is for
