#!/bin/bash
# slurm/curriculum.sh [--stages=a,b,c] [sbatch options...] -- [hydra overrides...]
#
# Submits the curriculum's stages as a chain of slurm/pretrain.sh jobs, stage i+1 with
# --dependency=afterok on stage i, each with `curriculum.only=<stage>` (all stages share the run
# dir, so each stage resumes from the previous stage's checkpoint). A preempted stage is requeued
# by pretrain.sh under the same job id, so the chain waits for it. Without --stages the stage names
# come from the Hydra-composed config (`python -m pretrain.train <overrides> --cfg job`), and
# without --nodes so does the node count (cluster.nodes: a recipe sets it).
#   slurm/curriculum.sh -- recipe=glm5_744b_h200x512 trainer.name=glm5-run1
#   slurm/curriculum.sh --nodes=64 -- curriculum=glm5 parallel=glm5_h200_512gpu trainer.name=glm5-run1
#   slurm/curriculum.sh --stages=pretrain,midtrain -- trainer.name=exp2
# Prints one line per stage: "<stage> <job id>".

set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv_python="$here/../.venv/bin/python"
[[ -x "$venv_python" ]] || venv_python=python3
PYTHON="${PYTHON:-$venv_python}"
stages=""
sbatch_args=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
    case "$1" in
        --stages=*) stages="${1#--stages=}" ;;
        *) sbatch_args+=("$1") ;;
    esac
    shift
done
[[ "${1:-}" == "--" ]] && shift
overrides=("$@")

# the job's nodes: --nodes/-N as given, else the config's cluster.nodes (a recipe's)
given_nodes=0
for a in "${sbatch_args[@]}"; do
    case "$a" in --nodes|--nodes=*|-N|-N*) given_nodes=1 ;; esac
done
if [[ -z "$stages" || $given_nodes == 0 ]]; then
    read -r found nodes < <(cd "$here/.." && "$PYTHON" -m pretrain.train "${overrides[@]}" --cfg job | "$PYTHON" -c '
import sys, yaml
cfg = yaml.safe_load(sys.stdin)
stages = (cfg.get("curriculum") or {}).get("stages") or []
names = list(stages) if isinstance(stages, dict) else [s["name"] for s in stages]
print(",".join(names) or "-", (cfg.get("cluster") or {}).get("nodes") or "-")')
    if [[ -z "$stages" ]]; then
        [[ "$found" != "-" ]] || { echo "curriculum.sh: the composed config has no curriculum.stages" >&2; exit 2; }
        stages="$found"
    fi
    [[ $given_nodes == 1 || "$nodes" == "-" ]] || sbatch_args+=("--nodes=$nodes")
fi

previous=""
IFS=, read -r -a names <<< "$stages"
for stage in "${names[@]}"; do
    dependency=()
    [[ -n "$previous" ]] && dependency=(--dependency="afterok:$previous")
    job=$(sbatch --parsable --job-name="glm5-$stage" "${dependency[@]}" "${sbatch_args[@]}" \
        "$here/pretrain.sh" "${overrides[@]}" "curriculum.only=$stage")
    job="${job%%;*}"
    echo "$stage $job"
    previous="$job"
done
