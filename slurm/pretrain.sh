#!/bin/bash
# sbatch slurm/pretrain.sh [hydra overrides...]
#
# One training run: one srun task per GPU (or per CPU rank when no GPU is allocated: gloo), no
# torchrun. Every #SBATCH default below can be overridden on the sbatch command line, e.g.
#   sbatch --nodes=64 --time=48:00:00 slurm/pretrain.sh model=glm5_744b parallel=glm5_512gpu trainer.name=exp1
#   sbatch --ntasks-per-node=4 --gpus-per-node=0 --cpus-per-task=1 slurm/pretrain.sh trainer.name=cpu4
# The run dir is runs/<trainer.name> (or trainer.run_dir) under the submit dir, so a requeued job
# continues the same run: it resumes from checkpoints/latest and appends to the same W&B run.
#
# Preemption: Slurm sends USR1 to this shell <grace> seconds before the time limit (or on
# `scancel --signal=USR1 --batch`); the trap forwards it to the tasks, which save a checkpoint
# after the current step and exit with status 75; the script then requeues the job. SIGTERM is
# forwarded the same way.
#
# Environment: PYTHON (default python3), CONTAINER_IMAGE and CONTAINER_MOUNTS (pyxis), NCCL_* and
# WANDB_* pass through to the tasks (sbatch exports the submit environment by default).
#
#SBATCH --job-name=glm5-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out

set -uo pipefail

PREEMPTED_EXIT=75  # pretrain.faults.PREEMPTED_EXIT

cd "${SLURM_SUBMIT_DIR:-.}"
mkdir -p logs

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

launch=(srun --export=ALL)
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    launch+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$PWD")
    [[ -n "${CONTAINER_MOUNTS:-}" ]] && launch+=(--container-mounts="$CONTAINER_MOUNTS")
fi

echo "[pretrain.sh] job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0}: ${SLURM_NTASKS} tasks on" \
     "${SLURM_JOB_NODELIST}, master ${MASTER_ADDR}:${MASTER_PORT}, GPUs '${SLURM_GPUS_ON_NODE:-0}'" \
     "overrides: $*"

signalled=""
forward() {  # bash runs a trap only between commands: the step runs in the background + wait
    signalled="$1"
    echo "[pretrain.sh] got SIG$1; asking the tasks to checkpoint and stop"
    # srun forwards USR1 to every task; a TERM sent to srun would make it kill the step instead,
    # so TERM is passed on as USR1 (the training treats both alike)
    kill -s USR1 "$step_pid" 2>/dev/null
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

"${launch[@]}" "${PYTHON:-python3}" -m pretrain.train "$@" &
step_pid=$!
while kill -0 "$step_pid" 2>/dev/null; do  # a trap interrupts `wait`: wait again
    wait "$step_pid"
done
wait "$step_pid"  # bash keeps the reaped step's status
rc=$?

if [[ $rc -eq $PREEMPTED_EXIT ]]; then
    echo "[pretrain.sh] checkpoint saved after SIG${signalled:-?}; requeueing job ${SLURM_JOB_ID}"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
echo "[pretrain.sh] training exited with status $rc"
exit "$rc"
