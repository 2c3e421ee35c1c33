"""The same preprocessing as a Slurm array job, through DataTrove's ``SlurmPipelineExecutor``.

One array task per output shard tokenises its share of the inputs into
``<final>.slurm/shard_<task>.*``; a dependent single-task job writes ``stats.json`` and renames the
folder to ``<final>``, so the output appears only when every shard is written. Resubmitting
skips tasks DataTrove has marked complete. Logs go to ``<cache_dir>/indexed/logs/<corpus>-<key>/``.
"""

from __future__ import annotations

import os

from datatrove.executor.slurm import SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep

from data_pipeline.config import CorpusConfig, DataConfig
from data_pipeline.corpus_steps import finalize, num_tasks, pipeline


class FinalizeCorpus(PipelineStep):
    name = "finalize corpus"
    type = "💾 - WRITER"

    def __init__(self, corpus: str, work_dir: str, final: str, tasks: int, files: list[str]):
        super().__init__()
        self.corpus, self.work_dir, self.final, self.tasks, self.files = corpus, work_dir, final, tasks, files

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        if not os.path.isdir(self.final):
            finalize(self.corpus, self.work_dir, self.tasks, self.files)
            os.rename(self.work_dir, self.final)
        yield from ()  # a pipeline step is a generator; this one passes no documents on


def executors(name: str, c: CorpusConfig, cfg: DataConfig, files: list[str], tok_path: str,
              final: str) -> tuple[SlurmPipelineExecutor, SlurmPipelineExecutor]:
    """(tokenize array job, finalize job depending on it)."""
    s = cfg.preprocess.slurm
    work = final + ".slurm"
    logs = os.path.join(os.path.dirname(final), "logs", os.path.basename(final))
    os.makedirs(work, exist_ok=True)
    common = dict(time=s.time, partition=s.partition, mem_per_cpu_gb=s.mem_per_cpu_gb, qos=s.qos,
                  venv_path=s.venv_path, sbatch_args=dict(s.sbatch_args), requeue=False, mail_user=None)
    tokenize = SlurmPipelineExecutor(
        pipeline=pipeline(name, c, cfg, files, tok_path, work), tasks=num_tasks(cfg),
        cpus_per_task=s.cpus_per_task, job_name=f"tokenize-{name}", logging_dir=os.path.join(logs, "tokenize"),
        **common)
    finish = SlurmPipelineExecutor(
        pipeline=[FinalizeCorpus(name, work, final, num_tasks(cfg), files)], tasks=1, cpus_per_task=1,
        job_name=f"finalize-{name}", logging_dir=os.path.join(logs, "finalize"), depends=tokenize, **common)
    return tokenize, finish


def submit(name: str, c: CorpusConfig, cfg: DataConfig, files: list[str], tok_path: str, final: str) -> None:
    _, finish = executors(name, c, cfg, files, tok_path, final)
    finish.run()  # launches the tokenize array first, then itself with afterok on it
