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
: "${MEMLOCK_LIMIT:=unlimited}"  # NCCL over InfiniBand registers (locks) its buffers
export NOFILE_LIMIT MEMLOCK_LIMIT

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
    for item in ${items[@]+"${items[@]}"}; do
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
    for item in ${items[@]+"${items[@]}"}; do
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

# A step of this job on one node, in AGM_STEP:
#
#   agm_step NODE [SRUN_OPTION...] -- [--ray-logs DIR] COMMAND...
#
# srun with the options given (each caller names the CPUs, memory and GPUs its step needs: srun
# 22.05-23.02 ignores SLURM_CPUS_PER_TASK, so a step that names none runs on one core), in
# CONTAINER_IMAGE when set (a .sif runs through Apptainer, anything else through pyxis: a squashfs
# file or an image reference), through slurm/step.sh (the limits; a Ray node's logs). Run it as
# `"${AGM_STEP[@]}" &` to have srun's own pid in $!, which is what signals must reach.
# AGM_HET_GROUP[node]: the hetjob component a node belongs to, when it is not the first.
declare -gA AGM_HET_GROUP=()
agm_step() {
    local node=$1
    shift
    AGM_STEP=(srun --nodes=1 --ntasks=1 -w "$node")
    [[ -z ${AGM_HET_GROUP[$node]:-} ]] || AGM_STEP+=("--het-group=${AGM_HET_GROUP[$node]}")
    while [[ $1 != -- ]]; do
        AGM_STEP+=("$1")
        shift
    done
    shift
    local -a wrapper=(bash "$PWD/slurm/step.sh") inner=()
    if [[ $1 == --ray-logs ]]; then
        wrapper+=("$1" "$2")
        shift 2
    fi
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
    AGM_STEP+=("${wrapper[@]}" ${inner[@]+"${inner[@]}"} "$@")
}

# A short command on a node, in the foreground, beside whatever runs there (--overlap: it shares
# the CPUs, memory and GPUs of the node's other steps; one CPU is all it needs).
agm_on_node() {
    local node=$1
    shift
    agm_step "$node" --overlap --cpus-per-task=1 -- "$@"
    "${AGM_STEP[@]}"
}

# The network interface the job's traffic uses (AGM_IFACE) and its IPv4 address on NODE
# (AGM_NODE_IP). NETWORK_INTERFACE names it; by default ib0 (IPoIB) where it has an address, else
# the interface of the default route. Not `hostname --ip-address`, which can return 127.0.1.1, an
# IPv6 address or the management network's address, where other nodes cannot reach Ray.
agm_node_address() {
    local node=$1 found
    # shellcheck disable=SC2016  # expanded on the node
    found=$(agm_on_node "$node" bash -c 'iface=$1
        if [[ -z $iface ]]; then
            if [[ -n $(ip -4 -o addr show dev ib0 2> /dev/null) ]]; then
                iface=ib0
            else
                iface=$(ip -4 -o route show default | awk "{print \$5; exit}")
            fi
        fi
        [[ -n $iface ]] || { echo "no default route: set NETWORK_INTERFACE" >&2; exit 1; }
        ip=$(ip -4 -o addr show dev "$iface" 2> /dev/null | awk "{split(\$4, a, \"/\"); print a[1]; exit}")
        [[ -n $ip ]] || { echo "interface $iface has no IPv4 address on $(hostname)" >&2; exit 1; }
        echo "$iface $ip"' _ "${NETWORK_INTERFACE:-}") || agm_die "no address to use on $node (NETWORK_INTERFACE=${NETWORK_INTERFACE:-})"
    # shellcheck disable=SC2034  # AGM_NODE_IP: read by the scripts that source this file
    read -r AGM_IFACE AGM_NODE_IP <<< "$found"
}

# NCCL and gloo use the interface Ray's addresses are on (megatron builds gloo groups too, and gloo
# would otherwise use the address the hostname resolves to); a site's own choice wins.
agm_export_interface() {
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$AGM_IFACE}
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$AGM_IFACE}
}

# Ray's files, per job: /tmp/ray is another user's on a shared node, and a job's own directory is
# where each node's step finds the logs it copies. Ray's socket paths (RAY_TMPDIR/ray/session_<date
# and pid>/sockets/plasma_store, 69 bytes more with a 7-digit pid) must fit Linux's 107 bytes.
agm_ray_tmpdir() {
    export RAY_TMPDIR=${RAY_TMPDIR:-/tmp/ray-${SLURM_JOB_ID:-local}}
    [[ ${#RAY_TMPDIR} -le 38 ]] || agm_die "RAY_TMPDIR=$RAY_TMPDIR: over 38 characters, Ray's socket paths" \
        "would pass Linux's 107-byte limit; choose a shorter directory"
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
    agm_end_steps ${AGM_STEPS[@]+"${AGM_STEPS[@]}"}
    AGM_STEPS=()
    AGM_STEP_NODES=()
}
