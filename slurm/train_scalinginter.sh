#!/bin/bash
# ScalingInter-RL training on Slurm: a Ray cluster over the allocation (head on the first node,
# workers on the others, env-server CPU nodes with their own resource), then `agentgym-mega
# train` on the head node, then Ray torn down and every node's Ray logs copied to logs/<job id>/.
#
#   sbatch slurm/train_scalinginter.sh ENV|CONFIG.yaml [key=value ...]
#
# ENV picks configs/ENV_scalinginter.yaml (babyai, textcraft, sciworld, deepsearch); a YAML path is
# used as is. The dotted overrides go to `agentgym-mega train` unchanged. Submit from the repository root
# with the environment that has agentgym-mega and ray on PATH active (sbatch exports it), or set
# CONTAINER_IMAGE. Size parallel.world_size (and rollout.num_engines * rollout.engine_tp with
# cluster.placement=split) to nodes * GPUs per node; the directives below are an example.
#
# Preemption and time limits: Slurm sends USR1 1800 s before the end (TERM at preemption, unless the
# site sets PreemptParameters=send_user_signal); the trainer finishes its step, checkpoints and
# exits 75, and the job requeues itself. The requeued job runs this script again with --resume
# auto, which continues at the next step. The job takes its nodes whole (--exclusive, --mem=0):
# offload, vLLM's sleeping weights and Ray's object store in /dev/shm all count against the job's
# memory, and Ray's ports are pinned. Every variable the script reads is in slurm/README.md.
#SBATCH --job-name=agentgym-scalinginter
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@1800
set -euo pipefail

# sbatch runs a copy of this file from its spool directory: the repository is the submit directory.
cd "${SLURM_SUBMIT_DIR:-.}"
# shellcheck source=slurm/common.sh
source slurm/common.sh

target=${1:?usage: sbatch slurm/train_scalinginter.sh babyai|textcraft|sciworld|CONFIG.yaml [key=value ...]}
shift
overrides=("$@")
if [[ $target == *.yaml || $target == *.yml ]]; then
    config=$target
else
    config=configs/${target}_scalinginter.yaml
fi
[[ -f $config ]] || agm_die "$config: no such config (an environment name: babyai, textcraft, sciworld; or a YAML path)"
subcommand=${AGM_SUBCOMMAND:-train}
restart=${SLURM_RESTART_COUNT:-0}
# The lead of --signal=B:USR1@ above, for the trainer's warning when a step plus a checkpoint may
# not fit in it (Slurm does not tell a job its own --signal).
export AGM_STOP_LEAD_S=${STOP_LEAD_S:-1800}

agm_log_dir
exec > >(tee -a "$AGM_LOG_DIR/driver.log") 2> >(tee -a "$AGM_LOG_DIR/driver.log" >&2)
agm_log "job ${SLURM_JOB_ID:-local} (restart $restart), config $config, logs in $AGM_LOG_DIR"
agm_ray_tmpdir
# Each Ray node's step keeps Ray up after a TERM until this file exists (slurm/step.sh).
export AGM_WORK_ENDED=$AGM_LOG_DIR/.work-ended-restart$restart
rm -f "$AGM_WORK_ENDED"

finished=0
finish() {
    # Once, also on errors: the work has ended, so each node's step stops Ray and copies its logs.
    [[ $finished == 0 ]] || return 0
    finished=1
    touch "$AGM_WORK_ENDED"
    agm_stop_steps
}
trap finish EXIT
# USR1 (Slurm's warning before the time limit) and TERM (preemption, scancel): the trainer stops
# after its step with a checkpoint, or, before it runs, the job requeues at once.
driver=
stop_requested=0
# shellcheck disable=SC2329  # called by the traps below
stop() {
    stop_requested=1
    [[ -z $driver ]] || kill -USR1 "$driver" 2> /dev/null || true
}
trap 'agm_log "USR1: stopping after the current step"; stop' USR1
trap 'agm_log "TERM: stopping after the current step"; stop' TERM
trap 'exit 130' INT

# The GPU nodes, and the CPU nodes for env servers: a hetjob's second component, or ENV_NODES
# (a count: the job's last N nodes; or node names, which need --nodelist to be in the job).
declare -a nodes env_nodes=()
if [[ -n ${SLURM_JOB_NODELIST_HET_GROUP_1:-} ]]; then
    # shellcheck disable=SC2153  # Slurm sets one per hetjob component
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0")
    mapfile -t env_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1")
    for node in ${env_nodes[@]+"${env_nodes[@]}"}; do
        AGM_HET_GROUP[$node]=1
    done
else
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    if [[ ${ENV_NODES:-} =~ ^[0-9]+$ ]]; then
        [[ $ENV_NODES -lt ${#nodes[@]} ]] || agm_die "ENV_NODES=$ENV_NODES: the job has ${#nodes[@]} node(s), and" \
            "at least one must be left for the GPUs"
        env_nodes=("${nodes[@]:${#nodes[@]}-ENV_NODES}")
        nodes=("${nodes[@]:0:${#nodes[@]}-ENV_NODES}")
    elif [[ -n ${ENV_NODES:-} ]]; then
        mapfile -t env_nodes < <(scontrol show hostnames "$ENV_NODES")
        gpu_nodes=()
        for node in "${nodes[@]}"; do
            [[ " ${env_nodes[*]} " == *" $node "* ]] || gpu_nodes+=("$node")
        done
        for node in ${env_nodes[@]+"${env_nodes[@]}"}; do
            [[ " ${nodes[*]} " == *" $node "* ]] || agm_die "ENV_NODES: $node is not a node of this job" \
                "(${nodes[*]}); give a count instead (ENV_NODES=2: the job's last two nodes)"
        done
        nodes=(${gpu_nodes[@]+"${gpu_nodes[@]}"})
    fi
fi
[[ ${#nodes[@]} -ge 1 ]] || agm_die "no GPU node left: ENV_NODES names every node of the job"
head_node=${nodes[0]}
cpus=${SLURM_CPUS_PER_TASK:-$(nproc)}
env_cpus=${ENV_NODE_CPUS:-${SLURM_CPUS_PER_TASK_HET_GROUP_1:-$cpus}}
if [[ ${#env_nodes[@]} -gt 0 ]]; then
    overrides+=(cluster.env_resource=env_node)
fi
agm_detect_gpus
agm_ray_port_args
[[ $GCS_PORT != 0 ]] || agm_die "GCS_PORT=0: the head needs a fixed port that the other nodes can dial"
[[ ${OBJECT_STORE_GB:=32} =~ ^[0-9]+$ && $OBJECT_STORE_GB -ge 1 ]] || agm_die "OBJECT_STORE_GB=$OBJECT_STORE_GB: expected a whole number of GiB >= 1"
object_store=--object-store-memory=$((OBJECT_STORE_GB * 1024 * 1024 * 1024))
gres=()
[[ $AGM_GPUS == 0 ]] || gres=("--gres=gpu:$AGM_GPUS")

# A bad config or override fails here, before any node starts Ray; the resolved config is kept.
agm_on_node "$head_node" agentgym-mega config --config "$config" ${overrides[@]+"${overrides[@]}"} > "$AGM_LOG_DIR/config.yaml"
# A GPU node whose environment cannot run the job (a CPU build of torch or vLLM, GPUs in a compute
# mode that rules out colocation) stops it here, naming the fix.
if [[ $AGM_GPUS -gt 0 && ${AGM_PREFLIGHT:-1} == 1 ]]; then
    for node in "${nodes[@]}"; do
        agm_step "$node" --overlap --cpus-per-task=1 ${gres[@]+"${gres[@]}"} -- \
            agentgym-mega preflight --config "$config" ${overrides[@]+"${overrides[@]}"}
        "${AGM_STEP[@]}" || agm_die "$node cannot run this job (agentgym-mega preflight above says why)"
    done
fi

# Ray authenticates every connection with a token; one per job, which srun hands to every step.
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$(python3 -c "import secrets; print(secrets.token_hex(32))")}
export RAY_AUTH_TOKEN
agm_node_address "$head_node"
head_ip=$AGM_NODE_IP
agm_export_interface
export RAY_ADDRESS="$head_ip:$GCS_PORT"
agm_log "network: $AGM_IFACE ($head_ip on $head_node); NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME" \
    "GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME${NCCL_IB_HCA:+ NCCL_IB_HCA=$NCCL_IB_HCA}"


start_ray() {  # node, its CPUs, srun options (its GPUs) --, then `ray start` flags of its own
    local node=$1 node_cpus=$2
    shift 2
    local -a options=()
    while [[ $1 != -- ]]; do
        options+=("$1")
        shift
    done
    shift
    agm_step "$node" --cpus-per-task="$node_cpus" --mem=0 ${options[@]+"${options[@]}"} -- \
        --ray-logs "$AGM_LOG_DIR/ray/$node-restart$restart" ray start --block --disable-usage-stats \
        ${AGM_RAY_PORT_ARGS[@]+"${AGM_RAY_PORT_ARGS[@]}"} "$object_store" "$@"
    "${AGM_STEP[@]}" &
    agm_watch $! "$node"
}
start_ray "$head_node" "$cpus" ${gres[@]+"${gres[@]}"} -- --head --node-ip-address="$head_ip" --port="$GCS_PORT" \
    --num-cpus="$cpus" --num-gpus="$AGM_GPUS" --include-dashboard=false
for node in "${nodes[@]:1}"; do
    agm_node_address "$node"
    start_ray "$node" "$cpus" ${gres[@]+"${gres[@]}"} -- --address="$RAY_ADDRESS" --node-ip-address="$AGM_NODE_IP" \
        --num-cpus="$cpus" --num-gpus="$AGM_GPUS"
done
for node in ${env_nodes[@]+"${env_nodes[@]}"}; do
    agm_node_address "$node"
    start_ray "$node" "$env_cpus" -- --address="$RAY_ADDRESS" --node-ip-address="$AGM_NODE_IP" \
        --num-cpus="$env_cpus" --num-gpus=0 --resources="{\"env_node\": $env_cpus}"
done

# Workers can only join once the head is up; wait until every node is alive in the cluster.
expected=$((${#nodes[@]} + ${#env_nodes[@]}))
deadline=$((SECONDS + ${RAY_START_TIMEOUT:-300}))
all_alive="
import ray, sys
ray.init(logging_level='ERROR')
alive = [n for n in ray.nodes() if n['Alive']]
if len(alive) < $expected:
    sys.exit(f'{len(alive)} of $expected nodes alive')
for n in alive:
    r = n['Resources']
    print(f\"  {n['NodeManagerAddress']}: node manager port {n['NodeManagerPort']}, object manager port \"
          f\"{n['ObjectManagerPort']}, {r.get('GPU', 0):g} GPUs, {r.get('CPU', 0):g} CPUs\"
          + (f\", env_node {r['env_node']:g}\" if 'env_node' in r else ''))
"
until agm_on_node "$head_node" python3 -c "$all_alive" 2> "$AGM_LOG_DIR/ray-wait.err"; do
    agm_check_steps || agm_die "Ray did not come up on every node"
    if [[ $SECONDS -ge $deadline ]]; then
        tail -3 "$AGM_LOG_DIR/ray-wait.err" >&2
        agm_die "Ray did not come up on all $expected nodes within ${RAY_START_TIMEOUT:-300} s"
    fi
    sleep 5
done
agm_log "Ray cluster up at $RAY_ADDRESS: ${#nodes[@]} node(s) of $AGM_GPUS GPUs (from $AGM_GPUS_FROM) and $cpus CPUs" \
    "each${env_nodes[*]:+, env servers on ${env_nodes[*]} (resource env_node)}"

requeue() {
    finish
    agm_log "$1: requeueing job $SLURM_JOB_ID"
    # Refused for a cancelled job, and where the site requeues a preempted job itself.
    scontrol requeue "$SLURM_JOB_ID" || agm_log "scontrol requeue refused: the job is not requeued by this script"
    exit 0
}
requeue_on=${REQUEUE:-1}
[[ -n ${SLURM_JOB_ID:-} ]] || requeue_on=0
if [[ $stop_requested == 1 && $requeue_on == 1 ]]; then
    requeue "asked to stop before training started"
fi

args=(--config "$config")
if [[ $subcommand == train && ${RESUME:-auto} != never ]]; then
    args+=(--resume "${RESUME:-auto}")  # auto: the latest checkpoint if there is one, else from the start
fi
agm_log "agentgym-mega $subcommand ${args[*]} ${overrides[*]:-}"
# Beside the head's Ray step, on all of its CPUs; srun passes USR1 on to the trainer, which stops
# after its step with a checkpoint.
agm_step "$head_node" --overlap --cpus-per-task="$cpus" -- agentgym-mega "$subcommand" "${args[@]}" \
    ${overrides[@]+"${overrides[@]}"}
"${AGM_STEP[@]}" &
driver=$!

node_lost() {
    agm_die "agentgym-mega $subcommand cannot go on without that node: job ended"
}
# Watch the Ray steps while the driver runs: a node that dies ends the job, naming it.
while kill -0 "$driver" 2> /dev/null; do
    if ! agm_check_steps; then
        kill -TERM "$driver" 2> /dev/null || true
        wait "$driver" || true
        node_lost
    fi
    sleep 5 &
    wait $! || true  # a signal ends the wait at once, not after the sleep
done
rc=0
wait "$driver" || rc=$?
# The driver can fail on a lost node before that node's step ends (a stopped raylet drains for up
# to 30 s): when Ray counts fewer live nodes, wait for the step that ends to name its node.
if [[ $rc != 0 && $rc != 75 && $stop_requested == 0 ]] && ! agm_on_node "$head_node" python3 -c "$all_alive" > /dev/null 2>&1; then
    for _ in $(seq "${NODE_LOSS_WAIT_S:-60}"); do
        agm_check_steps || node_lost
        sleep 1
    done
    agm_log "Ray lost a node, but every node's Ray step is still running"
fi
if [[ $rc == 75 && $requeue_on == 1 ]]; then
    requeue "the trainer stopped after a checkpoint (exit 75)"
fi
# Asked to stop before the trainer could take the signal (it dies of USR1, 138, or of Slurm's own
# TERM, 143): no checkpoint of this step, but the job goes on from the last one.
if [[ $stop_requested == 1 && ($rc == 138 || $rc == 143) && $requeue_on == 1 ]]; then
    requeue "the trainer ended on the stop signal before it could take it (exit $rc)"
fi
finish
agm_log "agentgym-mega $subcommand exited $rc"
exit "$rc"
