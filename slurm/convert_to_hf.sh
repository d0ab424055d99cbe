#!/bin/bash
# A megatron checkpoint of a run to a Hugging Face model directory, on one node:
#
#   sbatch slurm/convert_to_hf.sh CHECKPOINT OUT_DIR [--tp T --pp P]
#
# CHECKPOINT is a checkpoint directory or a root with a `latest` file (e.g.
# runs/babyai_scalinginter/checkpoints/actor); OUT_DIR receives safetensors shards, config and
# tokenizer, which transformers and vLLM load. --tp/--pp: the layout to run the export at (any
# layout reads any checkpoint; TP*PP ranks start on this node, one GPU each: submit with
# --gpus-per-node=TP*PP). The export holds the whole model in host memory (a 70B bf16 model is
# about 140 GB), hence --mem=0; AGM_DEVICE=cpu converts without GPUs (a CPU partition). Through
# CONTAINER_IMAGE like the training script; see slurm/README.md.
#SBATCH --job-name=agentgym-convert
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=16
#SBATCH --gpus-per-node=1
#SBATCH --mem=0
#SBATCH --time=02:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-.}"
# shellcheck source=slurm/common.sh
source slurm/common.sh

usage="usage: sbatch slurm/convert_to_hf.sh CHECKPOINT OUT_DIR [--tp T --pp P]"
checkpoint=${1:?$usage}
out=${2:?$usage}
shift 2
[[ -e $checkpoint ]] || agm_die "$checkpoint: no such checkpoint (a checkpoint directory, or a root with a \`latest\` file)"
node=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" | head -1)
agm_detect_gpus
gres=()
[[ $AGM_GPUS == 0 ]] || gres=("--gres=gpu:$AGM_GPUS")
agm_log "exporting $checkpoint to $out on $node"
agm_step "$node" --cpus-per-task="${SLURM_CPUS_PER_TASK:-$(nproc)}" --mem=0 ${gres[@]+"${gres[@]}"} -- \
    python3 -m checkpoint_tools.convert export --ckpt "$checkpoint" --out "$out" "$@"
"${AGM_STEP[@]}"
agm_log "done: $out"
