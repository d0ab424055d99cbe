#!/bin/bash
# ScalingInter-RL training on Slurm: a Ray cluster over the allocation (head on the first node,
# workers on the others), then `agentgym-mega train` on the head node, then Ray torn down.
#
#   sbatch slurm/train_scalinginter.sh ENV [key=value ...]
#
# ENV picks configs/ENV_scalinginter.yaml (babyai, textcraft, sciworld); the dotted overrides
# go to `agentgym-mega train` unchanged. Submit from the repository root with the environment
# that has agentgym-mega and ray on PATH active (sbatch exports it to the job).
# Size parallel.world_size (and rollout.num_engines * rollout.engine_tp with
# cluster.placement=split) to nodes * GPUs per node; the directives below are an example.
#
# Optional variables: RAY_PORT (6379), RAY_START_TIMEOUT (seconds to wait for every node, 300),
# AGM_SUBCOMMAND (`agentgym-mega` subcommand run on the cluster with the same config and
# overrides, default train; `config` only prints the resolved config: a dry run of the launch).
#SBATCH --job-name=agentgym-scalinginter
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

env_name=${1:?usage: sbatch slurm/train_scalinginter.sh babyai|textcraft|sciworld [key=value ...]}
shift
config=configs/${env_name}_scalinginter.yaml
# A bad config or override fails here, before any node starts Ray.
agentgym-mega config --config "$config" "$@" > /dev/null

# Ray authenticates every connection with a token; one per job, which srun hands to every step.
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$(python -c "import secrets; print(secrets.token_hex(32))")}
export RAY_AUTH_TOKEN

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes[0]}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')
export RAY_ADDRESS="$head_ip:${RAY_PORT:-6379}"
gpus=${SLURM_GPUS_PER_NODE:-0}
gpus=${gpus##*:}  # "h100:8" -> 8
cpus=${SLURM_CPUS_PER_TASK:-$(nproc)}

steps=()
stop_ray() {
    # Ending the blocking `ray start` steps stops Ray on every node.
    if [ ${#steps[@]} -gt 0 ]; then
        kill "${steps[@]}" 2> /dev/null || true
        wait "${steps[@]}" 2> /dev/null || true
    fi
}
trap stop_ray EXIT

srun --nodes=1 --ntasks=1 -w "$head_node" ray start --head --block --node-ip-address="$head_ip" \
    --port="${RAY_PORT:-6379}" --num-cpus="$cpus" --num-gpus="$gpus" --include-dashboard=false --disable-usage-stats &
steps+=($!)
for node in "${nodes[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" ray start --block --address="$RAY_ADDRESS" \
        --num-cpus="$cpus" --num-gpus="$gpus" --disable-usage-stats &
    steps+=($!)
done

# Workers can only join once the head is up; wait until every node is alive in the cluster.
deadline=$((SECONDS + ${RAY_START_TIMEOUT:-300}))
all_alive="import ray, sys; ray.init(logging_level='ERROR'); sys.exit(sum(n['Alive'] for n in ray.nodes()) < ${#nodes[@]})"
until python -c "$all_alive" 2> /dev/null; do
    if [ $SECONDS -ge $deadline ]; then
        echo "Ray did not come up on all ${#nodes[@]} nodes within ${RAY_START_TIMEOUT:-300} s:" >&2
        python -c "$all_alive" 2>&1 | tail -3 >&2 || true
        exit 1
    fi
    sleep 5
done
echo "Ray cluster up at $RAY_ADDRESS: ${#nodes[@]} nodes, $gpus GPUs and $cpus CPUs each"

agentgym-mega "${AGM_SUBCOMMAND:-train}" --config "$config" "$@"
