"""``python -m data_pipeline.prepare [hydra overrides]``: a training run's data, built ahead of it.

Takes the config and overrides of ``python -m pretrain.train`` and, for every stage the run would
train (its curriculum, or ``curriculum.start`` / ``only`` on), builds what the stage's datasets
need -- the tokenised corpora of its mixture (``data_pipeline.preprocess``) and its sample index
under ``<run_dir>/data_index/`` -- exactly as the run would, in this one process. One line per
stage: what was built or already there, and the seconds. Run it (``sbatch slurm/prepare.sh``)
before a launch over several nodes, which only checks its data and refuses to start without it.

Exit status: 0 every stage's data is prepared; 1 bad config or data (one ``error:`` line, as
``pretrain.train``); 2 corpora were submitted as Slurm jobs (``data.preprocess.executor=slurm``):
run it again once they finish.

The command reads the run's config, so its body lives with the run (``pretrain.data_prep``,
imported when it runs); nothing else in ``data_pipeline`` imports ``pretrain``.
"""

from __future__ import annotations

from parallel.megatron_compat import bootstrap

bootstrap()  # before megatron-core's first import

import sys


def main(argv: list[str] | None = None) -> int:
    from pretrain.data_prep import main as prepare_run  # the entry point's one import of the run

    return prepare_run(sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
