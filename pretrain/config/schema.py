"""The typed, strict run config. Each group's schema lives with the code that uses it; this file
assembles them and registers the whole in Hydra's ConfigStore so unknown keys are errors."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from data_pipeline.config import DataConfig
from model_providers.glm5.model.config import GLM5Config, PrecisionConfig
from parallel.config import ParallelConfig
from pretrain.config.cluster import ClusterChoice
from pretrain.curriculum import CurriculumConfig
from pretrain.reliability.faults import FaultsConfig


@dataclass
class MuonConfig:
    """Muon for hidden 2-D matrices when optimizer.name=muon (pretrain/optim/); the Adam fields
    of OptimizerConfig then serve embeddings, output layer, norms, router and 1-D parameters."""

    split: str = "per_head"  #: none | per_head (Muon Split: MLA up-projections per head, K/V apart)
    lr: Optional[float] = None  #: peak LR of the Muon groups; null = optimizer.lr
    min_lr: Optional[float] = None  #: null = optimizer.min_lr
    weight_decay: Optional[float] = None  #: decoupled; null = optimizer.weight_decay
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  #: Newton-Schulz (quintic) iterations
    ns_dtype: str = "fp32"  #: fp32 | bf16 (bf16 = torch.optim.Muon's own iteration)
    scale: str = "match_rms_adamw"  #: match_rms_adamw (update RMS = Adam's) | original


@dataclass
class OptimizerConfig:
    name: str = "adam"  #: adam (megatron's; AdamW-style decoupled weight decay) | muon (+ Adam)
    lr: float = 3e-3  #: peak learning rate
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    #: Adam moments' dtype: fp32 | bf16 (bf16: megatron's precision-aware optimizer, TE's
    #: FusedAdam on GPUs; halves the moments' memory)
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass
class SchedulerConfig:
    style: str = "cosine"  #: cosine | wsd | linear | constant (megatron OptimizerParamScheduler)
    init_lr: float = 0.0  #: LR at step 0 of the warm-up
    warmup_steps: int = 10
    decay_steps: Optional[int] = None  #: null = trainer.steps
    wsd_decay_steps: Optional[int] = None  #: WSD: length of the final decay; null = 20% of steps
    wsd_decay_style: str = "linear"  #: WSD decay shape: linear | cosine | exponential | minus_sqrt


@dataclass
class WandbConfig:
    mode: str = "offline"  #: online | offline | disabled
    project: str = "glm5-pretrain"
    entity: Optional[str] = None
    name: Optional[str] = None  #: null = trainer.name
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    log_every: int = 1  #: console line every N steps (metrics.jsonl gets every step)
    progress_bar: bool = True  #: a live bar when stdout is a terminal (never in a piped log)
    #: libraries' logs (megatron-core, datatrove, W&B, warnings) on the console too; they always
    #: go to <run_dir>/logs/rank<N>.log, and errors always reach the console
    verbose: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    save_every: int = 0  #: also save every this many steps (0 = off)
    #: also save when this many minutes of wall clock passed since the last save (0 = off); rank 0's
    #: clock decides and every rank learns it in the step's own all-reduce, so all save at one step
    save_every_minutes: float = 0.0
    #: write checkpoints in the background (megatron's async queue): the step loop stops only to
    #: copy this rank's shard to host memory; the manifest, ``latest`` and retention follow once
    #: every rank's files are written. null: on where there is CUDA, off on CPU runs
    async_save: Optional[bool] = None
    save_at_end: bool = True
    keep_last: int = 2  #: retain this many iteration folders (0 = all)
    init_from: Optional[str] = None  #: start weights from this checkpoint folder, or a checkpoints dir's newest (step 0, fresh optimizer)
    resume: bool = True  #: continue from the newest complete checkpoint in <run_dir>/checkpoints
    #: resuming with a config that trains differently (pretrain/config/resume_changes.py) is an error;
    #: true accepts it and records it in <run_dir>/config_history.jsonl
    allow_config_change: bool = False


@dataclass
class TrainerConfig:
    name: str = "glm5-tiny"  #: experiment name; the run dir is runs/<name> unless run_dir is set
    run_dir: str = "runs/${trainer.name}"
    steps: int = 60
    seq_length: int = 128
    micro_batch_size: int = 4
    global_batch_size: int = 16
    seed: int = 1234
    eval_every: int = 0  #: validation LM loss every N steps and at each stage end; 0 = never
    eval_samples: int = 16  #: validation sequences per evaluation
    lock_wait_s: float = 300.0  #: wait this long for another live run holding the run dir, then refuse


@dataclass
class RunConfig:
    model: GLM5Config = field(default_factory=GLM5Config)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    cluster: ClusterChoice = field(default_factory=ClusterChoice)  #: a recipe's hardware and nodes


#: the Hydra config tree ``python -m pretrain.train`` composes from
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")


def register() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def compose(overrides=()):
    """The config ``python -m pretrain.train *overrides`` runs with (unresolved DictConfig);
    inside the Hydra app it uses the app's config tree, elsewhere :data:`CONF_DIR`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    if GlobalHydra.instance().is_initialized():
        return hydra_compose("config", overrides=list(overrides))
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose("config", overrides=list(overrides))


def to_run_config(cfg) -> RunConfig:
    """Resolved OmegaConf -> plain dataclasses (checked against the schema once more).

    ``cfg`` is merged as a plain container: Hydra's ``+group.key=value`` force-adds keys to the
    typed nodes, and merging one typed node into another (then ``to_object``) would carry such a
    key along silently; merging plain values into the schema rejects it by name.
    """
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.to_container(cfg))
    OmegaConf.resolve(merged)
    return OmegaConf.to_object(merged)
