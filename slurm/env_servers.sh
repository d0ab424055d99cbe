#!/bin/bash
# A standalone fleet of environment servers on CPU nodes, for training runs that reach them by URL:
#
#   sbatch --nodes=2 --ntasks-per-node=8 slurm/env_servers.sh babyai|textcraft|sciworld|deepsearch|webarena [--option K=V ...]
#
# Arguments after the environment go to every `agentgym-mega env-server` (Deep Search's retriever:
# --option retriever_url=http://<retriever node>:8000 --option data_dir=/data/flashrag; WebArena's
# sites and tasks: --site shopping=http://<shop node>:7770 --option tasks=/data/webarena/config_files).
# Each node serves SLURM_NTASKS_PER_NODE servers on ports ENV_BASE_PORT (36001), +1, ..., bound
# to the node's address, with one shared secret that every request but GET /health must carry.
# Once all answer, logs/<job id>/env_urls.txt holds their URLs, env_servers.yaml the override to
# give a run, and env_secret (mode 600) the secret; the run reads it from $AGENTGYM_MEGA_SECRET:
#
#   export AGENTGYM_MEGA_SECRET=$(cat logs/<job id>/env_secret)
#   sbatch slurm/train_scalinginter.sh babyai "$(cat logs/<job id>/env_servers.yaml)"
#
# A server that exits is restarted on its port (ENV_MAX_RESTARTS times, 3 by default: then the
# fleet ends, naming it). Each server's step has its own --cpus-per-task cores (--exact) and, when
# Slurm says how much memory the job has per node, its share of it. Through CONTAINER_IMAGE like the
# training script; see slurm/README.md.
#SBATCH --job-name=agentgym-env-servers
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=4
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-.}"
# shellcheck source=slurm/common.sh
source slurm/common.sh

env_name=${1:?usage: sbatch slurm/env_servers.sh babyai|textcraft|sciworld|deepsearch|webarena [--option K=V ...]}
server_args=("${@:2}")
per_node=${SLURM_NTASKS_PER_NODE:-1}
per_node=${per_node%%(*}  # "4(x2)" -> 4
server_cpus=${SLURM_CPUS_PER_TASK:-1}
server_mem=()  # SLURM_MEM_PER_NODE is in MB
[[ ${SLURM_MEM_PER_NODE:-0} -gt 0 ]] && server_mem=("--mem=$((SLURM_MEM_PER_NODE / per_node))M")
base_port=${ENV_BASE_PORT:-36001}
max_restarts=${ENV_MAX_RESTARTS:-3}
agm_log_dir
exec > >(tee -a "$AGM_LOG_DIR/env_servers.log") 2> >(tee -a "$AGM_LOG_DIR/env_servers.log" >&2)

secret_file=$AGM_LOG_DIR/env_secret
(umask 077 && python3 -c "import secrets; print(secrets.token_urlsafe(32))" > "$secret_file")
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")

# One step per server: node, address and port, so that each can be restarted on its own.
server_node=() server_ip=() server_port=() server_pid=() server_restarts=()
start_server() {
    local i=$1
    # Servers sharing a node split its memory: each caps its instances at its share.
    agm_step "${server_node[$i]}" --exact --cpus-per-task="$server_cpus" ${server_mem[@]+"${server_mem[@]}"} -- \
        agentgym-mega env-server --env "$env_name" --host "${server_ip[$i]}" \
        --port "${server_port[$i]}" --secret-file "$secret_file" --memory-share "$(python3 -c "print(0.9 / $per_node)")" \
        ${server_args[@]+"${server_args[@]}"}
    "${AGM_STEP[@]}" &
    server_pid[i]=$!
}
stop_servers() {
    agm_end_steps ${server_pid[@]+"${server_pid[@]}"}
}
trap stop_servers EXIT
trap 'exit 143' TERM INT

urls=()
for node in "${nodes[@]}"; do
    agm_node_address "$node"
    ip=$AGM_NODE_IP
    for ((k = 0; k < per_node; k++)); do
        i=${#server_node[@]}
        server_node[i]=$node
        server_ip[i]=$ip
        server_port[i]=$((base_port + k))
        server_restarts[i]=0
        urls+=("http://$ip:${server_port[$i]}")
        start_server "$i"
    done
done

# Up when every server answers GET /health (the one request without the secret).
all_up="
import sys, urllib.request
for url in sys.argv[1:]:
    urllib.request.urlopen(url + '/health', timeout=5).read()
"
deadline=$((SECONDS + ${ENV_START_TIMEOUT:-300}))
until python3 -c "$all_up" "${urls[@]}" 2> /dev/null; do
    [[ $SECONDS -lt $deadline ]] || agm_die "not every env server answered within ${ENV_START_TIMEOUT:-300} s: ${urls[*]}"
    sleep 2
done
printf '%s\n' "${urls[@]}" > "$AGM_LOG_DIR/env_urls.txt"
(IFS=,; echo "env.server_urls=[${urls[*]}]") > "$AGM_LOG_DIR/env_servers.yaml"
agm_log "${#urls[@]} $env_name servers up on ${nodes[*]}: $AGM_LOG_DIR/env_urls.txt, override in" \
    "$AGM_LOG_DIR/env_servers.yaml, secret in $secret_file"

while true; do
    for i in "${!server_pid[@]}"; do
        kill -0 "${server_pid[$i]}" 2> /dev/null && continue
        rc=0
        wait "${server_pid[$i]}" || rc=$?
        where="${server_node[$i]} (${urls[$i]})"
        if [[ ${server_restarts[$i]} -ge $max_restarts ]]; then
            agm_die "the server on $where exited (exit $rc) after $max_restarts restarts: fleet ended"
        fi
        server_restarts[i]=$((server_restarts[i] + 1))
        agm_log "the server on $where exited (exit $rc): restart ${server_restarts[$i]} of $max_restarts"
        start_server "$i"
    done
    sleep 5 &
    wait $! || true
done
