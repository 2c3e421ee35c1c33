"""Curricula from config: every stage resolved and validated before any compute (errors name
the stage, the field and the value), token budgets turned into steps, LR schedules that start
where each stage says, data streams continued across stages, and where a restarted run begins."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from pretrain.config.schema import register, to_run_config
from pretrain.curriculum import Begin, CurriculumConfig, where_to_begin
from pretrain.curriculum import plan as plan_with_problems
from pretrain.config.validation import ConfigError, plan_run

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
register()


def _rc(*overrides: str):
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base=None):
        return to_run_config(compose("config", overrides=list(overrides)))


@pytest.fixture(autouse=True)
def no_process_group():
    yield
    assert not dist.is_initialized(), "planning a curriculum must not start torch.distributed"


def plan(rc):
    stages, problems = plan_with_problems(rc)
    assert problems == []
    return stages


def _error(*overrides, world=1) -> str:
    with pytest.raises(ConfigError) as e:
        plan_run(_rc(*overrides), world)
    return str(e.value)


def test_tiny_curriculum_resolves_every_stage():
    stages = plan_run(_rc(), 1)
    assert [s.name for s in stages] == ["pretrain_general", "pretrain_code_reasoning", "extend_256",
                                        "extend_512", "extend_1024", "dsa_warmup", "dsa_sparse"]
    assert [s.rc.trainer.seq_length for s in stages] == [128, 128, 256, 512, 1024, 1024, 1024]
    assert [s.rc.model.dsa.mode for s in stages] == ["dense"] * 5 + ["warmup", "sparse"]
    assert [s.rc.data.mixture for s in stages][:2] == ["default", "code_reasoning"]
    assert [s.optimizer_state for s in stages][-2:] == ["reset", "reset"]
    # a stage's LR schedule is its own: peak/end/warm-up of the config, decayed over its steps
    for s in stages:
        assert s.rc.scheduler.decay_steps == s.steps == s.rc.trainer.steps
    assert (stages[0].rc.optimizer.lr, stages[0].rc.optimizer.min_lr) == (3e-3, 2e-3)
    assert stages[0].rc.scheduler.warmup_steps == 2
    assert stages[6].rc.scheduler.style == "constant" and stages[6].rc.optimizer.lr == 1.5e-4


def test_glm5_recipe_numbers():
    stages = plan(_rc("curriculum=glm5", "model=glm5_744b", "data=samples"))
    by = {s.name: s for s in stages}
    assert by["dsa_warmup"].steps == 1000
    assert by["dsa_warmup"].tokens_per_step == 14 * 202752
    assert by["dsa_warmup"].rc.model.dsa.mode == "warmup"
    assert (by["dsa_warmup"].rc.optimizer.lr, by["dsa_warmup"].rc.optimizer.min_lr) == (5e-3, 2e-4)
    assert by["dsa_sparse"].rc.optimizer.lr == 1e-5 and by["dsa_sparse"].rc.scheduler.style == "constant"
    tokens = {s.name: s.steps * s.tokens_per_step for s in stages}
    # budgets are rounded up to whole steps: within one step of the report's numbers
    for name, want in [("pretrain_general", 18e12), ("pretrain_code_reasoning", 9e12),
                       ("midtrain_32k", 1e12), ("midtrain_128k", 5e11), ("midtrain_200k", 5e10),
                       ("dsa_sparse", 2e10)]:
        assert want <= tokens[name] < want + by[name].tokens_per_step, name
    assert sum(tokens.values()) == pytest.approx(28.57e12, rel=0.001)  # the report: "~28.5T"
    assert [by[n].rc.trainer.seq_length for n in ("midtrain_32k", "midtrain_128k", "midtrain_200k")] == [
        32768, 131072, 202752]
    # the pretraining LR: 0 -> 2e-4 warm-up, held, then decayed to 4e-5 by the end of 27T
    assert by["pretrain_general"].rc.scheduler.init_lr == 0.0
    assert by["pretrain_code_reasoning"].rc.optimizer.min_lr == 4e-5
    assert by["midtrain_32k"].rc.optimizer.lr == 4e-5 and by["midtrain_200k"].rc.optimizer.min_lr == 1e-5


def test_same_stream_stages_continue_their_data():
    stages = plan(_rc())
    by = {s.name: s for s in stages}
    # extend_1024 -> dsa_warmup -> dsa_sparse read one stream (long_context at 1024)
    assert by["extend_1024"].data_offset == 0
    assert by["dsa_warmup"].data_offset == 4 * 2
    assert by["dsa_sparse"].data_offset == 4 * 2 + 8 * 2
    assert by["extend_1024"].stream_samples == by["dsa_sparse"].stream_samples == (4 + 8 + 6) * 2
    assert by["pretrain_code_reasoning"].data_offset == 0  # other mixture: other stream


@pytest.mark.parametrize("overrides, message", [
    (["curriculum.stages.0.steps=0"],
     "curriculum.stages[0] (pretrain_general).steps=0 must be > 0"),
    (["curriculum.stages.1.steps=-3"],
     "curriculum.stages[1] (pretrain_code_reasoning).steps=-3 must be > 0"),
    (["curriculum.stages.2.tokens=1000"],
     "curriculum.stages[2] (extend_256): set one of tokens (1000.0) and steps (6), not both"),
    (["curriculum.stages.4.seq_length=8192"],
     "stage 'extend_1024': trainer.seq_length=8192 exceeds model.max_position_embeddings=4096"),
    (["curriculum.stages.3.mixture=long_contxt"],
     "stage 'extend_512': data.mixture='long_contxt' is not one of data.mixtures"),
    (["model.dsa.kl_coeff=0"],
     "curriculum.stages[5] (dsa_warmup).dsa_mode=warmup trains the indexer through its KL loss, "
     "but model.dsa.kl_coeff=0.0"),
    (["model.dsa.index_heads=0"],
     "curriculum.stages[5] (dsa_warmup).dsa_mode=warmup needs the DSA indexer fields: "
     "model.dsa.index_heads=0"),
    (["+curriculum.stages.2.parallel.tp=3"],
     "stage 'extend_256': world size 1 is not divisible by parallel.tp*pp*cp = 3*1*1 = 3"),
    (["+curriculum.stages.2.parallel.tensor_parallel=2"],
     "curriculum.stages[2] (extend_256).parallel={'tensor_parallel': 2}: Key 'tensor_parallel' not in 'ParallelConfig'"),
    (["curriculum.stages.6.optimizer_state=carry"],
     "curriculum.stages[6] (dsa_sparse).optimizer_state=carry, but it trains other parameters than 'dsa_warmup'"),
    (["curriculum.stages.5.lr.warmup_steps=8"],
     "curriculum.stages[5] (dsa_warmup).lr.warmup_steps=8 must be in [0, the stage's 8 steps)"),
    (["curriculum.stages.6.lr.warmup_steps=6"],  # constant too: megatron's scheduler asserts it
     "curriculum.stages[6] (dsa_sparse).lr.warmup_steps=6 must be in [0, the stage's 6 steps)"),
    (["curriculum.stages.6.lr.warmup_steps=null", "scheduler.warmup_steps=6"],
     "scheduler.warmup_steps (for curriculum.stages[6] (dsa_sparse))=6 must be in [0, the stage's 6 steps)"),
    (["curriculum.stages.1.name=pretrain_general"],
     "curriculum.stages: the name 'pretrain_general' is used more than once"),
    (["curriculum.only=extend_2048"], "curriculum.only='extend_2048' is not a stage"),
    (["curriculum.stages.0.lr.style=cosin"],
     "curriculum.stages[0] (pretrain_general).lr.style='cosin' must be one of"),
    (["curriculum.stages.4.rope_type=yarn"],
     "stage 'extend_1024': model.yarn.factor=1.0 must be > 1 with model.rope_type=yarn"),
    (["curriculum.stages.4.rope_type=yarm", "+curriculum.stages.4.yarn.factor=4"],
     "stage 'extend_1024': model.rope_type='yarm' must be rope or yarn"),
    (["curriculum.stages.4.rope_type=yarn", "+curriculum.stages.4.yarn.factor=4",
      "+curriculum.stages.4.yarn.beta_slow=64"],
     "stage 'extend_1024': model.yarn.beta_fast=32.0 and beta_slow=64.0 must satisfy"),
    (["+curriculum.stages.4.yarn.factr=4"],
     "curriculum.stages[4] (extend_1024).yarn={'factr': 4}: Key 'factr' not in 'YarnConfig'"),
    (["+curriculum.stages.4.yarn.factor=big"],
     "curriculum.stages[4] (extend_1024).yarn={'factor': 'big'}: Value 'big' of type 'str' could not "
     "be converted to Float"),
])
def test_bad_curricula_are_rejected_before_compute(overrides, message):
    assert message in _error(*overrides)


def test_a_stage_switches_to_yarn():
    """Stage overrides are per stage (like rope_theta): extend_1024 trains with YaRN, the others
    keep the model's plain RoPE; the stage's config is what megatron's MLA is built from."""
    from model_providers.glm5.model.config import PrecisionConfig, YarnConfig, to_transformer_config

    stages = plan_run(_rc("curriculum.stages.4.rope_type=yarn", "+curriculum.stages.4.yarn.factor=8",
                          "+curriculum.stages.4.yarn.original_max_position_embeddings=128"), 1)
    by = {s.name: s for s in stages}
    assert by["extend_1024"].rc.model.rope_type == "yarn"
    assert by["extend_1024"].rc.model.yarn == YarnConfig(factor=8.0, original_max_position_embeddings=128)
    assert [s.rc.model.rope_type for s in stages] == ["rope"] * 4 + ["yarn", "rope", "rope"]
    assert by["extend_512"].rc.model.yarn == YarnConfig()
    t = to_transformer_config(by["extend_1024"].rc.model, by["extend_1024"].rc.parallel, PrecisionConfig())
    assert (t.rope_type, t.rotary_scaling_factor, t.original_max_position_embeddings) == ("yarn", 8.0, 128)


def test_a_model_without_an_indexer_refuses_indexer_stages():
    """``model.dsa.mode=none`` (DeepSeek-V3) builds no indexer: a warm-up or sparse stage is
    refused naming both fields, dense stages stay none (same attention, no indexer to freeze),
    and a stage may not drop the indexer of a model that has one."""
    msg = _error("model=deepseek_v3_tiny")
    for i, name, mode in ((5, "dsa_warmup", "warmup"), (6, "dsa_sparse", "sparse")):
        assert (f"curriculum.stages[{i}] ({name}).dsa_mode={mode} needs the DSA lightning indexer, "
                "but model.dsa.mode=none builds none") in msg
    assert "stages[0]" not in msg  # its dense stage is fine
    stages = plan_run(_rc("model=deepseek_v3_tiny", "curriculum.stages.5.dsa_mode=null",
                          "curriculum.stages.6.dsa_mode=dense"), 1)
    assert [s.rc.model.dsa.mode for s in stages] == ["none"] * 7
    msg = _error("curriculum.stages.0.dsa_mode=none")
    assert ("curriculum.stages[0] (pretrain_general).dsa_mode=none removes the DSA indexer that "
            "model.dsa.mode=dense builds") in msg


def test_parallel_override_must_divide_the_world():
    msg = _error("+curriculum.stages.6.parallel.tp=2", "+curriculum.stages.6.parallel.sequence_parallel=true",
                 world=3)
    assert "stage 'dsa_sparse': world size 3 is not divisible by parallel.tp*pp*cp = 2*1*1 = 2" in msg


def test_every_problem_is_listed_at_once():
    msg = _error("curriculum.stages.0.steps=0", "curriculum.stages.3.mixture=nope")
    assert "curriculum.stages[0] (pretrain_general).steps=0 must be > 0" in msg
    assert "stage 'extend_512': data.mixture='nope'" in msg
    msg = _error("curriculum.stages.3.mixture=nope", "curriculum.stages.4.seq_length=9000")
    assert "stage 'extend_512': data.mixture='nope'" in msg and "stage 'extend_1024'" in msg


def test_no_stages_is_one_implicit_stage_from_trainer():
    stages = plan_run(_rc("curriculum=none", "trainer.steps=17"), 1)
    assert len(stages) == 1 and stages[0].name == "pretrain" and stages[0].steps == 17
    assert stages[0].rc.scheduler.warmup_steps == 10 and stages[0].rc.optimizer.lr == 3e-3


# --- where a (re)started run begins ------------------------------------------------------------


def _where(latest, **cur):
    return where_to_begin(plan(_rc()), CurriculumConfig(**cur), latest)


def test_begin_fresh_resume_or_carry():
    assert _where(None) == Begin(0, "fresh", 6)
    assert _where({"stage": "extend_256", "stage_step": 2, "step": 28}) == Begin(2, "resume", 6)
    assert _where({"stage": "extend_256", "stage_step": 6, "step": 32}) == Begin(3, "carry", 6)
    assert _where({"stage": "dsa_sparse", "stage_step": 6, "step": 54}).done


def test_begin_with_start_and_only():
    assert _where(None, start="extend_512") == Begin(3, "fresh", 6)
    assert _where(None, only="extend_512") == Begin(3, "fresh", 3)
    # one Slurm job per stage: stage 3's job picks up the end of stage 2
    assert _where({"stage": "extend_256", "stage_step": 6}, only="extend_512") == Begin(3, "carry", 3)
    assert _where({"stage": "extend_512", "stage_step": 1}, only="extend_512") == Begin(3, "resume", 3)
    assert _where({"stage": "extend_512", "stage_step": 4}, only="extend_512").done
    with pytest.raises(ConfigError, match=r"curriculum.only='extend_512', but the latest checkpoint "
                                              r"is at step 2/6 of stage 'extend_256'"):
        _where({"stage": "extend_256", "stage_step": 2}, only="extend_512")
    # start= skips ahead explicitly, carrying the weights it has
    assert _where({"stage": "pretrain_general", "stage_step": 5}, start="extend_512") == Begin(3, "carry", 6)
    with pytest.raises(ConfigError, match="stage 'old_stage', which this curriculum does not have"):
        _where({"stage": "old_stage", "stage_step": 1})


def test_glm5_curriculum_trains_with_muon_split_and_stage_lrs_reach_muon():
    stages = plan(_rc("curriculum=glm5", "model=glm5_744b", "data=samples"))
    by = {s.name: s for s in stages}
    for s in stages:
        assert s.rc.optimizer.name == "muon" and s.rc.optimizer.muon.split == "per_head"
    # muon_split.yaml gives Muon the same peak as Adam (ratio 1): every stage's LRs reach it
    assert (by["dsa_warmup"].rc.optimizer.muon.lr, by["dsa_warmup"].rc.optimizer.muon.min_lr) == (5e-3, 2e-4)
    assert by["dsa_sparse"].rc.optimizer.muon.lr == pytest.approx(1e-5)
    ratio = plan(_rc("optimizer=muon_split", "optimizer.muon.lr=4e-3"))  # tiny: adam lr 3e-3 -> 2e-4
    assert ratio[0].rc.optimizer.muon.lr == pytest.approx(3e-3 * 4e-3 / 2e-4)


def test_a_cluster_preset_sets_a_stage_layout_over_the_stage_own_fields():
    stages = plan(_rc("curriculum=glm5", "model=glm5_744b", "data=samples", "parallel.tp=2",
                      "parallel.sequence_parallel=true",
                      "+parallel.stages={midtrain_32k: {cp: 4, pp: 2, recompute: full}, dsa_warmup: {vpp: null}}"))
    by = {s.name: s.rc.parallel for s in stages}
    assert (by["midtrain_32k"].cp, by["midtrain_32k"].pp, by["midtrain_32k"].tp) == (4, 2, 2)  # cp: 2 in the recipe
    assert by["midtrain_128k"].cp == 8 and by["midtrain_128k"].pp == 1  # the recipe's own
    assert by["pretrain_general"].cp == 1
    assert stages[2].rc.model.recompute == "full" and stages[3].rc.model.recompute == "selective"


def test_a_cluster_preset_naming_no_stage_is_refused():
    stages, problems = plan_with_problems(_rc("curriculum=glm5", "model=glm5_744b", "data=samples",
                                              "+parallel.stages={midtrain_32K: {cp: 4}}"))
    assert any(p.startswith("parallel.stages.midtrain_32K: no curriculum stage is named 'midtrain_32K'")
               for p in problems), problems
    stages, problems = plan_with_problems(_rc("curriculum=glm5", "model=glm5_744b", "data=samples",
                                              "+parallel.stages={midtrain_32k: {cpp: 4}}"))
    assert any("parallel.stages.midtrain_32k" in p and "cpp" in p for p in problems), problems


def test_the_glm5_recipe_brings_its_model_and_corpus_and_the_command_line_still_wins():
    """``curriculum=glm5`` alone is GLM-5 744B on the GLM-5 corpus (its stages name that
    corpus's mixtures); ``model=`` / ``data=`` on the command line replace them."""
    rc = _rc("curriculum=glm5")
    assert rc.model.num_layers == 78 and rc.model.hidden_size == 6144
    stage_mixtures = {st.rc.data.mixture for st in plan_with_problems(rc)[0]}
    assert stage_mixtures <= set(rc.data.mixtures) and "pretrain" in stage_mixtures
    rc = _rc("curriculum=glm5", "model=glm5_tiny", "data=samples")
    assert rc.model.num_layers == 4 and "pretrain" not in rc.data.mixtures
