#!/bin/bash
# sbatch slurm/prepare.sh [hydra overrides...]        (submit from the repo root)
#
# A training run's data, built ahead of it: `python -m data_pipeline.prepare <overrides>` as one
# task on one node -- every curriculum stage's tokenised corpora and sample index under
# <run dir>/data_index/, exactly as the run would build them. Pass the overrides the run will get:
#   sbatch slurm/prepare.sh recipe=glm5_744b_h200x512 trainer.name=glm5-run1
#   sbatch --nodes=64 slurm/pretrain.sh recipe=glm5_744b_h200x512 trainer.name=glm5-run1
# A launch over several nodes only checks its data and stops with an error naming the stage and
# this command when some is missing (its ranks would otherwise wait in a collective, past the
# process group's timeout, while one of them builds). To start training once it is done:
#   jid=$(sbatch --parsable slurm/prepare.sh <overrides>)
#   sbatch --dependency=afterok:$jid --nodes=64 slurm/pretrain.sh <overrides>
#
# Every #SBATCH default below can be overridden on the sbatch command line. The index build of a
# GLM-5 stage takes 0.1-0.3 h on data.index_threads (16) cores and up to ~2 TB of memory at 100%
# (docs/data.md "Data at full scale"): the whole node. With data.preprocess.executor=slurm the
# corpora are submitted as Slurm array jobs of their own; the command then exits with status 2
# and is run again once they finish (the sample indices need them).
#
# Log: <job name>-<job id>.out in the submit dir. Environment: PYTHON (default: the repo's
# .venv/bin/python when there, else python3); CONTAINER_IMAGE / CONTAINER_MOUNTS as in
# slurm/pretrain.sh.
#
#SBATCH --job-name=glm5-prepare
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=08:00:00
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -uo pipefail

cd "${SLURM_SUBMIT_DIR:-.}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

venv_python="$PWD/.venv/bin/python"
[[ -x "$venv_python" ]] || venv_python=python3
launch=(srun --export=ALL --ntasks=1 --nodes=1)
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    venv_python=python3  # the image's Python
    launch+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$PWD")
    mounts="${CONTAINER_MOUNTS-$PWD:$PWD}"  # unset: the repo; set (even empty): as given
    [[ -n "$mounts" ]] && launch+=(--container-mounts="$mounts")
fi

echo "[prepare.sh] job ${SLURM_JOB_ID:-none} on ${SLURM_JOB_NODELIST:-$(hostname)}: overrides: $*"
"${launch[@]}" "${PYTHON:-$venv_python}" -m data_pipeline.prepare "$@"
rc=$?
echo "[prepare.sh] data_pipeline.prepare exited with status $rc"
exit "$rc"
