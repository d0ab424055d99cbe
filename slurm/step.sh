#!/bin/bash
# What every job step runs on its node (slurm/common.sh's agm_step puts it in front of the step's
# command): raises the open-files and locked-memory limits, which a site need not propagate (Slurm
# hands steps the submit host's limits; NCCL over InfiniBand fails in ibv_reg_mr under the usual
# 64 KiB memlock), then runs the command.
#
#   step.sh [--ray-logs DIR] COMMAND...
#
# --ray-logs: a Ray node's step. Its node's Ray logs are copied to DIR when the step ends, however
# it ends, because once a job is cancelled or past its time limit slurmctld refuses new steps, so
# no later step could fetch them. On TERM (scancel, the time limit, preemption) Ray is kept up
# until the job's work has ended (the file AGM_WORK_ENDED exists) or RAY_TERM_GRACE_S have passed,
# so that a trainer stopping on the same TERM can still write its checkpoint; then Ray is stopped
# and the logs copied.
set -uo pipefail

logs=
if [[ ${1:-} == --ray-logs ]]; then
    logs=$2
    shift 2
fi
ulimit -n "${NOFILE_LIMIT:-65536}" 2> /dev/null || ulimit -n "$(ulimit -Hn)"
ulimit -l "${MEMLOCK_LIMIT:-unlimited}" 2> /dev/null || ulimit -l "$(ulimit -Hl)"
# Where NCCL runs (Ray's workers, under a Ray node's step); said once per node.
if [[ -n $logs && ${AGM_DEVICE:-gpu} != cpu && $(ulimit -l) != unlimited ]]; then
    echo "[$(date '+%F %T')] warning: locked memory is limited to $(ulimit -l) KiB on $(hostname) (hard limit" \
        "$(ulimit -Hl)): NCCL over InfiniBand may fail to register memory; ask the site to raise memlock" >&2
fi
[[ -n $logs ]] || exec "$@"

# Copies the node's Ray logs so far: on the TERM at once, since Slurm's KILL follows it after
# KillWait (30 s by default) while Ray's own stop may drain that long; again when the step ends.
copy_logs() {
    local src=${RAY_TMPDIR:-/tmp}/ray/session_latest/logs
    [[ -d $src ]] || return 0
    mkdir -p "$logs" && cp -r "$src/." "$logs" ||
        echo "[$(date '+%F %T')] error: $(hostname)'s Ray logs were not all copied to $logs" >&2
}

"$@" &
child=$!
term_at=
copied=0
stopping=0
trap '[[ -n $term_at ]] || term_at=$SECONDS' TERM INT
# `wait` returns early whenever a trapped signal arrives: go on watching until the command ends,
# stopping it once the work has ended or the grace has passed.
while kill -0 "$child" 2> /dev/null; do
    if [[ -n $term_at && $stopping == 0 ]]; then
        [[ $copied == 1 ]] || { copy_logs; copied=1; }
        if [[ -e ${AGM_WORK_ENDED:-/nonexistent} ]] || ((SECONDS - term_at >= ${RAY_TERM_GRACE_S:-20})); then
            stopping=1
            kill -TERM "$child" 2> /dev/null
        fi
    fi
    sleep 1 &
    wait $!
done
wait "$child"
rc=$?
copy_logs
exit "$rc"
