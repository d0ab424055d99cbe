# shellcheck shell=bash
# What the Slurm scripts share, sourced (never run): logging, GPUs per node from whatever Slurm
# exported, Ray's ports, a job step on one node (through a container when CONTAINER_IMAGE is
# set), the per-job log directory, and watching the steps that must outlive the job's work.
# Every setting is an environment variable with a default; slurm/README.md lists them.

agm_log() { echo "[$(date '+%F %T')] $*"; }
agm_die() { echo "[$(date '+%F %T')] error: $*" >&2; exit 1; }

# Ray's ports. The GCS port is the head's; the others are each node's own, the same on every
# node so that a site's firewall can open exactly these. 0 leaves a port to Ray (several nodes
# on one host, as in the tests). Bare names: Ray reads RAY_* variables as its own settings.
: "${GCS_PORT:=6379}" "${NODE_MANAGER_PORT:=6380}" "${OBJECT_MANAGER_PORT:=6381}"
: "${RUNTIME_ENV_AGENT_PORT:=6382}" "${DASHBOARD_AGENT_GRPC_PORT:=6383}" "${METRICS_EXPORT_PORT:=6384}"
: "${DASHBOARD_AGENT_LISTEN_PORT:=52365}" "${MIN_WORKER_PORT:=10002}" "${MAX_WORKER_PORT:=19999}"
: "${NOFILE_LIMIT:=65536}"  # Ray holds a socket per worker and object: Linux's usual 1024 runs out

# `ray start` flags for the node-local ports (a 0 port is left out: Ray picks one).
agm_ray_port_args() {
    local flag name value
    AGM_RAY_PORT_ARGS=()
    for flag in node-manager-port:NODE_MANAGER_PORT object-manager-port:OBJECT_MANAGER_PORT \
        runtime-env-agent-port:RUNTIME_ENV_AGENT_PORT dashboard-agent-grpc-port:DASHBOARD_AGENT_GRPC_PORT \
        dashboard-agent-listen-port:DASHBOARD_AGENT_LISTEN_PORT metrics-export-port:METRICS_EXPORT_PORT \
        min-worker-port:MIN_WORKER_PORT max-worker-port:MAX_WORKER_PORT; do
        name=${flag#*:}
        value=${!name}
        [[ $value =~ ^[0-9]+$ ]] || agm_die "$name=$value: expected a port number (0: Ray picks)"
        [[ $value == 0 ]] || AGM_RAY_PORT_ARGS+=("--${flag%%:*}=$value")
    done
}

# Counts GPU indices such as "0,1,2,3" or "0-3,6" (SLURM_JOB_GPUS, SLURM_STEP_GPUS).
agm_count_indices() {
    local item count=0
    local -a items
    IFS=, read -ra items <<< "$1"
    for item in "${items[@]}"; do
        if [[ $item =~ ^([0-9]+)-([0-9]+)$ ]]; then
            count=$((count + BASH_REMATCH[2] - BASH_REMATCH[1] + 1))
        elif [[ $item =~ ^[0-9]+$ ]]; then
            count=$((count + 1))
        else
            return 1
        fi
    done
    echo "$count"
}

# GPUs in a gres or TRES string: "gpu:8", "gpu:h100:8(S:0-1)", "gres/gpu:4,gres/nvme:1".
agm_count_gres() {
    local item count=0
    local -a items
    IFS=, read -ra items <<< "$1"
    for item in "${items[@]}"; do
        item=${item#gres/}
        item=${item%%(*}
        [[ $item == gpu || $item == gpu:* ]] || continue
        if [[ ${item##*:} =~ ^[0-9]+$ ]]; then
            count=$((count + ${item##*:}))
        else
            count=$((count + 1))  # "gpu" or "gpu:type": one
        fi
    done
    echo "$count"
}

# Sets AGM_GPUS (GPUs per node) and AGM_GPUS_FROM (the variable it came from). A site that
# allocates with --gres leaves SLURM_GPUS_PER_NODE unset; the others are read in this order.
# AGM_DEVICE=cpu: a run on CPUs, Ray is told of no GPUs whatever Slurm allotted.
agm_detect_gpus() {
    local name value count
    AGM_GPUS=0
    AGM_GPUS_FROM=none
    for name in GPUS_PER_NODE SLURM_GPUS_PER_NODE SLURM_GPUS_ON_NODE SLURM_JOB_GPUS SLURM_STEP_GPUS \
        SLURM_TRES_PER_NODE SLURM_GRES; do
        value=${!name:-}
        [[ -n $value ]] || continue
        case $name in
            GPUS_PER_NODE | SLURM_GPUS_ON_NODE) count=$value ;;
            SLURM_GPUS_PER_NODE) count=${value##*:} ;;  # "h100:8" -> 8
            SLURM_JOB_GPUS | SLURM_STEP_GPUS) count=$(agm_count_indices "$value") || count= ;;
            *) count=$(agm_count_gres "$value") ;;
        esac
        [[ $count =~ ^[0-9]+$ ]] || agm_die "$name=$value: cannot read a GPU count from it"
        AGM_GPUS=$count
        AGM_GPUS_FROM=$name
        break
    done
    if [[ ${AGM_DEVICE:-gpu} == cpu ]]; then
        agm_log "AGM_DEVICE=cpu: Ray gets no GPUs (Slurm allotted $AGM_GPUS per node, from $AGM_GPUS_FROM)"
        AGM_GPUS=0
    elif [[ ${AGM_DEVICE:-gpu} != gpu ]]; then
        agm_die "AGM_DEVICE=$AGM_DEVICE: expected gpu or cpu"
    elif [[ $AGM_GPUS -lt 1 ]]; then
        agm_die "no GPUs in this job: none of GPUS_PER_NODE, SLURM_GPUS_PER_NODE, SLURM_GPUS_ON_NODE," \
            "SLURM_JOB_GPUS, SLURM_STEP_GPUS, SLURM_TRES_PER_NODE, SLURM_GRES names any. Submit with" \
            "--gpus-per-node=N or --gres=gpu:N, set GPUS_PER_NODE=N, or AGM_DEVICE=cpu for a CPU run"
    fi
}

# A per-job log directory (absolute: the steps may start elsewhere) that keeps its restarts.
agm_log_dir() {
    AGM_LOG_DIR=$(realpath -m "${LOG_DIR:-logs/${SLURM_JOB_ID:-local}}")
    mkdir -p "$AGM_LOG_DIR"
}

# A step of this job on one node, in AGM_STEP: srun, in CONTAINER_IMAGE when set (a .sif runs
# through Apptainer, anything else through pyxis: a squashfs file or an image reference), with
# the open-files limit raised inside the step too (sites need not propagate it). Run it as
# `"${AGM_STEP[@]}" &` to have srun's own pid in $!, which is what signals must reach.
# AGM_HET_GROUP[node]: the hetjob component a node belongs to, when it is not the first.
declare -gA AGM_HET_GROUP=()
agm_step() {
    local node=$1
    shift
    AGM_STEP=(srun --overlap --nodes=1 --ntasks=1 -w "$node")
    [[ -z ${AGM_HET_GROUP[$node]:-} ]] || AGM_STEP+=("--het-group=${AGM_HET_GROUP[$node]}")
    local -a inner=()
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        if [[ $CONTAINER_IMAGE == *.sif ]]; then
            inner=(apptainer exec --pwd "$PWD" --bind "$PWD${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}")
            [[ ${AGM_DEVICE:-gpu} == cpu ]] || inner+=(--nv)
            inner+=("$CONTAINER_IMAGE")
        else
            # A named container is created once per node and reused by the job's later steps.
            AGM_STEP+=("--container-image=$CONTAINER_IMAGE" "--container-name=agentgym-${SLURM_JOB_ID:-local}"
                "--container-mounts=$PWD:$PWD${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}" "--container-workdir=$PWD")
        fi
    fi
    # shellcheck disable=SC2016  # expanded by the step's own bash
    AGM_STEP+=(bash -c 'ulimit -n "$1" 2> /dev/null || ulimit -n "$(ulimit -Hn)"; shift; exec "$@"'
        _ "$NOFILE_LIMIT" "${inner[@]}" "$@")
}

# Runs a step on a node in the foreground.
agm_on_node() {
    agm_step "$@"
    "${AGM_STEP[@]}"
}

# Background steps that must live as long as the job's work: their pids and their nodes.
AGM_STEPS=()
AGM_STEP_NODES=()
agm_watch() {
    AGM_STEPS+=("$1")
    AGM_STEP_NODES+=("$2")
}

# Fails (status 1, with a message naming the node) when a watched step has ended.
agm_check_steps() {
    local i rc
    for i in "${!AGM_STEPS[@]}"; do
        if ! kill -0 "${AGM_STEPS[$i]}" 2> /dev/null; then
            rc=0
            wait "${AGM_STEPS[$i]}" || rc=$?
            echo "[$(date '+%F %T')] error: the Ray step on node ${AGM_STEP_NODES[$i]} ended (exit $rc)" >&2
            return 1
        fi
    done
}

# Ends background steps by pid: all are signalled first, then each is waited for.
agm_end_steps() {
    local pid
    for pid in "$@"; do
        kill "$pid" 2> /dev/null || true
    done
    for pid in "$@"; do
        wait "$pid" 2> /dev/null || true
    done
}

# Ends the watched steps (a blocking `ray start` stops Ray on its node when its step ends).
agm_stop_steps() {
    agm_end_steps "${AGM_STEPS[@]}"
    AGM_STEPS=()
    AGM_STEP_NODES=()
}
