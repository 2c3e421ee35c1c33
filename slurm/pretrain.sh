#!/bin/bash
# sbatch slurm/pretrain.sh [hydra overrides...]        (submit from the repo root)
#
# One training run: one srun task per GPU (or per CPU rank when no GPU is allocated: gloo), no
# torchrun (a script of your own that launches torchrun should run `python -m pretrain.torchrun`
# instead: torchrun exits 1, not 75, after a preemption; docs/reliability.md). Every #SBATCH
# default below can be overridden on the sbatch command line, e.g.
#   sbatch --nodes=64 --time=48:00:00 --signal=B:USR1@900 slurm/pretrain.sh recipe=glm5_744b_h200x512 trainer.name=exp1
#   sbatch --ntasks-per-node=4 --gpus-per-node=0 --cpus-per-task=1 slurm/pretrain.sh trainer.name=cpu4
# The run dir is runs/<trainer.name> (or trainer.run_dir) under the submit dir, so a requeued job
# continues the same run: it resumes from checkpoints/latest and appends to the same W&B run.
#
# Log: <job name>-<job id>.out in the submit dir (sbatch opens --output before this script runs,
# so its folder must exist at submission: for a logs/ folder, `mkdir -p logs` and pass
# --output=logs/%x-%j.out).
#
# Preemption: Slurm sends USR1 to this shell <grace> seconds before the time limit (or on
# `scancel --signal=USR1 --batch`); the trap forwards it to the tasks, which save a checkpoint
# after the current step and exit with status 75; the script then requeues the job. SIGTERM is
# forwarded the same way. The grace (--signal=B:USR1@<seconds>, 300 here) must cover the step in
# flight plus one checkpoint save plus ~60 s: save time ~ checkpoint bytes / the file system's
# aggregate write bandwidth, checkpoint ~ 14 bytes per parameter with Adam (bf16 weights, fp32
# main weights and two moments): glm5_744b ~10.5 TB, ~530 s at 20 GB/s -> --signal=B:USR1@900;
# 300 s covers ~4 TB at 20 GB/s. Too short a grace and the time limit kills the save (the run
# then resumes from the previous checkpoint).
#
# Environment: PYTHON (default python3). CONTAINER_IMAGE runs the tasks in that image (pyxis),
# with the submit dir (the repo) mounted at the same path and as the working dir;
# CONTAINER_MOUNTS replaces that mount list (include the repo; empty: no mounts). NCCL_* and
# WANDB_* pass through to the tasks (sbatch exports the submit environment by default);
# CUDA_DEVICE_MAX_CONNECTIONS, PYTORCH_CUDA_ALLOC_CONF and TORCH_NCCL_AVOID_RECORD_STREAMS get
# the defaults below unless set.
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
#SBATCH --output=%x-%j.out

set -uo pipefail

PREEMPTED_EXIT=75  # pretrain.reliability.faults.PREEMPTED_EXIT

cd "${SLURM_SUBMIT_DIR:-.}"

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# megatron's TP/SP communication overlap needs kernels issued in order on one hardware queue
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# stages change sequence length and batch: growable segments instead of fragmented fixed blocks
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# NCCL frees its inputs when the collective ends, not when the caching allocator next syncs
export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"

# one task failing (a CUDA error, an OOM) ends the step instead of leaving the others blocked in
# a collective until the time limit
launch=(srun --export=ALL --kill-on-bad-exit=1)
if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
    launch+=(--container-image="$CONTAINER_IMAGE" --container-workdir="$PWD")
    mounts="${CONTAINER_MOUNTS-$PWD:$PWD}"  # unset: the repo; set (even empty): as given
    [[ -n "$mounts" ]] && launch+=(--container-mounts="$mounts")
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

# After a signal, a task that exits 75 first makes srun (--kill-on-bad-exit) kill the others, and
# srun then reports their signal, not 75: any failure after a signal is a preemption (the
# requeued job resumes from the newest checkpoint that verifies).
if [[ $rc -eq $PREEMPTED_EXIT || ( -n "$signalled" && $rc -ne 0 ) ]]; then
    echo "[pretrain.sh] training stopped (status $rc) after SIG${signalled:-?}; requeueing job ${SLURM_JOB_ID}"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
echo "[pretrain.sh] training exited with status $rc"
exit "$rc"
