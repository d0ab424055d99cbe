"""The Slurm scripts without Slurm: stand-in `srun` (runs the step's command here), `scontrol`
(lists node names, records requeues) and `sbatch --wait` (runs the batch script here) on PATH,
so the scripts' own Ray bring-up (a head and nodes joining it, all on this machine), waits,
training, signals, requeue, resume and teardown really run. sbatch's directives and separate
machines are left to a real cluster."""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import REPO, TINY_TEXTCRAFT, assert_finite_losses, run_cli

pytestmark = pytest.mark.slow

SLURM = os.path.join(REPO, "slurm")
# The options a real srun takes that the scripts use; any other is refused, so a typo or an option
# srun does not know fails here as it would on a cluster.
SRUN_OPTIONS = {"--nodes", "--ntasks", "-w", "--het-group", "--cpus-per-task", "--mem", "--gres", "--overlap",
                "--exact", "--container-image", "--container-name", "--container-mounts", "--container-workdir"}
# What a step's environment must carry to every node, recorded with each step.
STEP_ENV = ("RAY_TMPDIR", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "MEMLOCK_LIMIT",
            "NOFILE_LIMIT", "AGM_STOP_LEAD_S", "AGM_WORK_ENDED", "RAY_ADDRESS")
SRUN = f"""#!/bin/bash
# srun stand-in: records the step (pid, options, command, the environment it hands on) as a JSON
# line in $SRUN_LOG, then runs the command on this machine. Strict where srun's versions differ: a
# step without --cpus-per-task is refused (srun 22.05-23.02 ignores SLURM_CPUS_PER_TASK), as is an
# option srun does not take. A step of a ray start on $SRUN_FAIL_NODE fails at once, as on a node
# that is down; one whose command matches $SRUN_HOLD waits before running it (a slow start).
node=
options=()
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in -w) node=$2; options+=("-w=$2"); shift 2 ;; *) options+=("$1"); shift ;; esac
done
{sys.executable} - "$$" "$node" "${{#options[@]}}" "${{options[@]}}" "$@" <<'PY' || exit 2
import json, os, sys
pid, node, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
options, command = sys.argv[4:4 + count], sys.argv[4 + count:]
names = {{o.split("=", 1)[0] for o in options}}
unknown = names - set({sorted(SRUN_OPTIONS)!r})
if unknown or "--cpus-per-task" not in names:
    sys.exit(f"srun: refused {{options}}: unknown {{sorted(unknown)}}, or no --cpus-per-task")
env = {{k: os.environ[k] for k in {STEP_ENV!r} if k in os.environ}}
with open(os.environ["SRUN_LOG"], "a") as f:
    f.write(json.dumps({{"pid": int(pid), "node": node, "options": options, "command": command, "env": env}}) + "\\n")
PY
[[ -n $SRUN_FAIL_NODE && $node == "$SRUN_FAIL_NODE" && "$*" == *"ray start"* ]] && exit 3
[[ -n $SRUN_HOLD && "$*" == *$SRUN_HOLD* ]] && sleep 60
exec "$@"
"""
SCONTROL = """#!/bin/bash
case $1 in
    show) tr ',' '\\n' <<< "$3" ;;
    requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
esac
"""
SBATCH = """#!/bin/bash
# sbatch --wait stand-in: records its options in $SBATCH_LOG, then runs the batch script here, now,
# as job 4300+ on nodes node-1..node-N.
nodes=1 output=slurm-%j.out
while [[ $# -gt 0 && $1 == -* ]]; do
    echo "$1" >> "$SBATCH_LOG"
    case $1 in --nodes=*) nodes=${1#*=} ;; --output=*) output=${1#*=} ;; esac
    shift
done
job=$((4300 + RANDOM % 100))
echo "Submitted batch job $job"
SLURM_JOB_ID=$job SLURM_JOB_NODELIST=$(seq -f node-%g -s, "$nodes") bash "$@" > "${output//%j/$job}" 2>&1
"""
NODE_PORTS = ("NODE_MANAGER_PORT", "OBJECT_MANAGER_PORT", "RUNTIME_ENV_AGENT_PORT", "DASHBOARD_AGENT_GRPC_PORT",
              "DASHBOARD_AGENT_LISTEN_PORT", "METRICS_EXPORT_PORT")


@pytest.fixture
def slurm_env(tmp_path):
    """The environment of a job on nodes node-a and node-b (GPUs given --gres style), with this
    test's own Ray (a short temp dir: Ray's socket paths have a length limit) and log directory.
    Several "nodes" share this host: their own ports are left to Ray (0), and the network interface
    is loopback. Steps are recorded in tmp_path/srun.jsonl (see steps())."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL), ("sbatch", SBATCH)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    ray_dir = tempfile.mkdtemp(prefix="agm-ray-", dir="/tmp")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-a,node-b", SLURM_JOB_GPUS="0,1",
               SLURM_CPUS_PER_TASK="2", GCS_PORT=str(fixed_port()), RAY_TMPDIR=ray_dir,
               LOG_DIR=str(tmp_path / "logs"), SCONTROL_LOG=str(tmp_path / "scontrol.log"), RAY_START_TIMEOUT="180",
               SRUN_LOG=str(tmp_path / "srun.jsonl"), SBATCH_LOG=str(tmp_path / "sbatch.log"),
               NETWORK_INTERFACE="lo", NCCL_IB_HCA="mlx5_0,mlx5_1", OBJECT_STORE_GB="1")
    env |= {name: "0" for name in NODE_PORTS}
    for name in ("RAY_ADDRESS", "SLURM_SUBMIT_DIR", "SLURM_RESTART_COUNT", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        env.pop(name, None)
    yield env
    left = subprocess.run(["pgrep", "-f", ray_dir], capture_output=True, text=True).stdout.split()
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    shutil.rmtree(ray_dir, ignore_errors=True)
    assert not left, f"Ray processes left running: {left}"


def steps(tmp_path) -> list[dict]:
    """The steps srun was asked for, in order: pid, node, options, command and environment."""
    path = tmp_path / "srun.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def step_of(recorded: list[dict], *words: str, node: str | None = None) -> dict:
    """The one recorded step whose command holds each of `words` (and runs on `node`)."""
    found = [s for s in recorded if all(w in " ".join(s["command"]) for w in words) and node in (None, s["node"])]
    assert len(found) == 1, f"{len(found)} steps run {words} on {node}: {[s['command'] for s in recorded]}"
    return found[0]


def assert_ray_node_step(step: dict, cpus: int, gpus: int, logs: str):
    """A Ray node's step: its CPUs named, the node's memory, its GPUs, not overlapping other steps,
    its logs copied by its own wrapper; the interface, memlock and Ray's directory handed on."""
    assert f"--cpus-per-task={cpus}" in step["options"] and "--mem=0" in step["options"]
    assert ("--gres=gpu:%d" % gpus in step["options"]) == (gpus > 0) and "--overlap" not in step["options"]
    assert step["command"][1].endswith("slurm/step.sh") and step["command"][2:4] == ["--ray-logs", logs]
    env = step["env"]
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert env["MEMLOCK_LIMIT"] == "unlimited" and env["RAY_TMPDIR"] and env["AGM_STOP_LEAD_S"] == "1800"


def launch(env, *args, script="train_scalinginter.sh", timeout=600):
    return subprocess.run(["bash", os.path.join(SLURM, script), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_hetjob_with_gres_gpus_step_resources_and_ray_logs_of_every_node(slurm_env, tmp_path):
    """A heterogeneous job: node-a (component 0, GPUs given --gres style) and the env node node-b
    (component 1): each Ray step asks for its own CPUs, memory and GPUs, in its component; the
    checks beside them overlap; every node copies its own Ray logs when its step ends."""
    env = slurm_env | {
        "SLURM_JOB_NODELIST_HET_GROUP_0": "node-a", "SLURM_JOB_NODELIST_HET_GROUP_1": "node-b",
        "SLURM_CPUS_PER_TASK_HET_GROUP_1": "1", "AGM_SUBCOMMAND": "config",
        "AGM_PREFLIGHT": "0"}  # this machine's CPU torch would (rightly) fail the GPU check
    env.pop("SLURM_JOB_GPUS")
    env["SLURM_GRES"] = "gpu:h100:2(S:0-1)"  # what --gres=gpu:h100:2 leaves, SLURM_GPUS_PER_NODE unset
    result = launch(env, "babyai", "trainer.total_steps=7", "cluster.placement=split")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "1 node(s) of 2 GPUs (from SLURM_GRES) and 2 CPUs each, env servers on node-b" in result.stdout
    assert re.search(r", env_node 1\b", result.stdout)
    assert "total_steps: 7" in result.stdout and "caps:\n  - 6\n  - 13\n  - 20" in result.stdout
    assert "network: lo (127.0.0.1 on node-a); NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo NCCL_IB_HCA=mlx5_0,mlx5_1" \
        in result.stdout
    logs = tmp_path / "logs"
    assert "placement: split" in (logs / "config.yaml").read_text()  # the resolved config
    assert "total_steps: 7" in (logs / "driver.log").read_text()

    recorded = steps(tmp_path)
    head, env_node = step_of(recorded, "ray start", "--head"), step_of(recorded, "ray start", node="node-b")
    assert_ray_node_step(head, cpus=2, gpus=2, logs=str(logs / "ray" / "node-a-restart0"))
    assert_ray_node_step(env_node, cpus=1, gpus=0, logs=str(logs / "ray" / "node-b-restart0"))
    assert "--het-group=1" in env_node["options"] and not any(o.startswith("--het-group") for o in head["options"])
    assert "--node-ip-address=127.0.0.1" in env_node["command"] and '--resources={"env_node": 1}' in env_node["command"]
    assert f"--object-store-memory={1024 ** 3}" in head["command"]
    # the config's check before Ray, then the driver (here `config` again) beside the head's Ray step
    check, driver = [s for s in recorded if s["command"][2:4] == ["agentgym-mega", "config"]]
    assert {"--overlap", "--cpus-per-task=1"} <= set(check["options"]) and recorded.index(check) < recorded.index(head)
    assert {"--overlap", "--cpus-per-task=2"} <= set(driver["options"]) and driver["node"] == "node-a"
    for node in ("node-a", "node-b"):  # copied by each node's own step, as it ended
        assert (logs / "ray" / f"{node}-restart0" / "raylet.out").is_file()


def test_a_node_that_does_not_start_ends_the_job_naming_it(slurm_env):
    # A start timeout past launch()'s own: a job that waited it out instead of noticing would fail
    # that, however slowly a loaded machine starts the head.
    env = slurm_env | {"SLURM_JOB_NODELIST": "node-a,node-dead", "SRUN_FAIL_NODE": "node-dead",
                       "AGM_SUBCOMMAND": "config", "RAY_START_TIMEOUT": "1200", "AGM_PREFLIGHT": "0"}
    result = launch(env, "babyai", timeout=600)
    assert result.returncode == 1
    assert "the Ray step on node node-dead ended (exit 3)" in result.stderr


def test_bad_input_stops_before_ray_starts(slurm_env):
    result = launch(slurm_env | {"AGM_SUBCOMMAND": "config"}, "babyai", "trainer.total_stepz=7")
    assert result.returncode == 2 and "trainer.total_stepz" in result.stderr
    assert "Ray cluster up" not in result.stdout
    no_gpus = {k: v for k, v in slurm_env.items() if k != "SLURM_JOB_GPUS"}
    result = launch(no_gpus, "babyai")
    assert result.returncode == 1 and "no GPUs in this job" in result.stderr
    result = launch(slurm_env, "nosuchenv")
    assert result.returncode == 1 and "configs/nosuchenv_scalinginter.yaml: no such config" in result.stderr
    result = launch(slurm_env | {"AGM_DEVICE": "cpu", "ENV_NODES": "2"}, "babyai")
    assert result.returncode == 1 and "ENV_NODES=2: the job has 2 node(s)" in result.stderr
    # GPUs allotted, but this environment's torch is the CPU build: every GPU node is checked first
    result = launch(slurm_env, "babyai")
    assert result.returncode == 1 and "node-a cannot run this job" in result.stderr, result.stderr[-2000:]
    assert "CPU build" in result.stderr and "Ray cluster up" not in result.stdout


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def tiny_training(tmp_path, steps: int) -> list[str]:
    """The launch command of a tiny TextCraft training on CPU (AGM_DEVICE=cpu) writing to tmp_path/run."""
    model = tmp_path / "tiny"
    assert run_cli("make-tiny-model", "--out", str(model), "--kv-heads", "2").returncode == 0
    overrides = [
        f"model.path={model}", *TINY_TEXTCRAFT,
        # RLOO's only run through the loop (tests/e2e/test_estimators.py runs gae and grpo)
        "algorithm.estimator=rloo",
        "horizon.schedule=scaling_inter", "horizon.caps=[1,2,3]", "horizon.interval=1",
        f"trainer.total_steps={steps}", f"trainer.output_dir={tmp_path / 'run'}",
    ]
    return ["bash", os.path.join(SLURM, "train_scalinginter.sh"), os.path.join("configs", "base.yaml"), *overrides]


def start_and_wait_for_a_step(command, env, out_path) -> subprocess.Popen:
    """The job started in the background, once its first step is logged."""
    metrics = out_path.parent / "run" / "metrics.jsonl"
    with open(out_path, "w") as out:
        job = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not metrics.is_file() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    return job


def test_term_at_preemption_checkpoints_requeues_and_the_same_command_resumes(slurm_env, tmp_path):
    """node-a trains (CPU: AGM_DEVICE=cpu, though Slurm allotted GPUs), node-b is an env node (the
    job's last node: ENV_NODES=1). Preemption as Slurm does it: TERM to the batch shell and to
    every step at once. The trainer stops after its step with a checkpoint (exit 75) while the Ray
    steps keep Ray up (a site whose GraceTime leaves RAY_TERM_GRACE_S), the job requeues, and each
    node's own step copies its Ray logs: no step starts after the signal. The requeued job's same
    command resumes at the next step and turn cap."""
    command = tiny_training(tmp_path, steps=3)
    run_dir = tmp_path / "run"
    env = slurm_env | {"AGM_DEVICE": "cpu", "ENV_NODES": "1", "RAY_TERM_GRACE_S": "600"}
    job = start_and_wait_for_a_step(command, env, tmp_path / "out-0")
    recorded = steps(tmp_path)
    for pid in [job.pid] + [s["pid"] for s in recorded]:
        with contextlib.suppress(ProcessLookupError):  # the short checks before Ray have ended
            os.kill(pid, signal.SIGTERM)
    assert job.wait(timeout=600) == 0, (tmp_path / "out-0").read_text()[-4000:]
    logs = tmp_path / "logs"
    first = (logs / "driver.log").read_text()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert "TERM: stopping after the current step" in first and "exit 75" in first and "requeueing job 4242" in first
    stopped = int((run_dir / "checkpoints" / "actor" / "latest").read_text().strip().removeprefix("iter_"))
    assert stopped < 3 and [m["step"] for m in read_metrics(run_dir)] == list(range(1, stopped + 1))
    # node-b joined with the env servers' resource, and the run placed its servers by it
    assert re.search(r", env_node 2\b", first) and "env servers on node-b (resource env_node)" in first
    assert "env_resource: env_node" in (logs / "config.yaml").read_text()
    assert re.search(r"\(\w+ pid=\d+", first), "workers' output reaches the driver's log"
    assert len(steps(tmp_path)) == len(recorded)  # nothing asked of Slurm after the signal ...
    for node in ("node-a", "node-b"):  # ... and each node's logs are home
        assert (logs / "ray" / f"{node}-restart0" / "raylet.out").is_file()
    head, env_node = step_of(recorded, "ray start", "--head"), step_of(recorded, "ray start", node="node-b")
    assert_ray_node_step(head, cpus=2, gpus=0, logs=str(logs / "ray" / "node-a-restart0"))
    assert_ray_node_step(env_node, cpus=2, gpus=0, logs=str(logs / "ray" / "node-b-restart0"))
    driver = step_of(recorded, "agentgym-mega train", "--resume auto")
    assert {"--overlap", "--cpus-per-task=2"} <= set(driver["options"]) and driver["node"] == "node-a"
    assert driver["env"]["RAY_ADDRESS"].endswith(f":{env['GCS_PORT']}")

    result = subprocess.run(command, cwd=REPO, env=env | {"SLURM_RESTART_COUNT": "1"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "job 4242 (restart 1)" in result.stdout and "--resume auto" in result.stdout
    steps_run = read_metrics(run_dir)
    assert [m["step"] for m in steps_run] == [1, 2, 3]  # the resumed run went on at stopped + 1
    assert [m["horizon/turn_cap"] for m in steps_run] == [1, 2, 3]
    assert steps_run[-1]["rollout/logprob_diff"] <= 1e-4  # the engine serves the resumed weights
    for m in steps_run:
        assert_finite_losses(m)
        assert "actor/ref_kl" not in m  # no KL, no reference model
    assert (run_dir / "checkpoints" / "actor" / "latest").read_text().strip() == "iter_0000003"
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # a finished run is not requeued

    hf = tmp_path / "hf"
    result = launch(slurm_env, str(run_dir / "checkpoints" / "actor"), str(hf), script="convert_to_hf.sh")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((hf / "config.json").read_text())["model_type"] and list(hf.glob("*.safetensors"))
    convert = step_of(steps(tmp_path), "checkpoint_tools.convert export")
    assert {"--cpus-per-task=2", "--mem=0", "--gres=gpu:2"} <= set(convert["options"])


def test_a_stop_before_the_trainer_takes_signals_still_requeues(slurm_env, tmp_path):
    """USR1 while the trainer's step is starting (it dies of the signal, exit 138): the job
    requeues all the same, and the next start resumes from the last checkpoint."""
    env = slurm_env | {"AGM_DEVICE": "cpu", "SLURM_JOB_NODELIST": "node-a", "SRUN_HOLD": "agentgym-mega train"}
    command = ["bash", os.path.join(SLURM, "train_scalinginter.sh"), os.path.join("configs", "base.yaml"),
               *TINY_TEXTCRAFT, f"trainer.output_dir={tmp_path / 'run'}"]
    with open(tmp_path / "out", "w") as out:
        job = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not any("agentgym-mega" in s["command"] and "train" in s["command"] for s in steps(tmp_path)):
        assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "out").read_text()[-3000:]
        time.sleep(0.5)
    job.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@1800: to the batch shell
    assert job.wait(timeout=300) == 0, (tmp_path / "out").read_text()[-3000:]
    log = (tmp_path / "logs" / "driver.log").read_text()
    assert "the trainer ended on the stop signal before it could take it (exit 138)" in log
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"


def test_a_node_lost_during_training_ends_the_job_naming_it(slurm_env, tmp_path):
    env = slurm_env | {"AGM_DEVICE": "cpu"}
    # far more steps than a run can take before the loss ends it, whichever node its roles were on
    job = start_and_wait_for_a_step(tiny_training(tmp_path, steps=1000), env, tmp_path / "out")
    node_b = subprocess.run(["pgrep", "-f", f"bin/ray start --block .*--address=.*:{env['GCS_PORT']}"],
                            capture_output=True, text=True).stdout.split()
    assert len(node_b) == 1
    os.kill(int(node_b[0]), signal.SIGTERM)  # Ray on node-b stops, as when the node goes
    assert job.wait(timeout=300) == 1
    out = (tmp_path / "out").read_text()
    assert "the Ray step on node node-b ended" in out and "cannot go on without that node: job ended" in out
    steps = [m["step"] for m in read_metrics(tmp_path / "run")]
    assert 1 <= len(steps) < 1000


def test_env_server_fleet_serves_with_a_secret_and_restarts_a_server_that_dies(slurm_env, tmp_path):
    base = fixed_port(2)  # the two servers' ports
    env = slurm_env | {"SLURM_JOB_NODELIST": "node-a", "SLURM_NTASKS_PER_NODE": "2", "ENV_BASE_PORT": str(base),
                       "SLURM_MEM_PER_NODE": "4000"}
    logs = tmp_path / "logs"
    with open(tmp_path / "out", "w") as out:
        fleet = subprocess.Popen(["bash", os.path.join(SLURM, "env_servers.sh"), "babyai"], cwd=REPO, env=env,
                                 stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while not (logs / "env_urls.txt").is_file() and fleet.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
            urls = (logs / "env_urls.txt").read_text().split()
            assert len(urls) == 2 and urls[1].endswith(f":{base + 1}") and urls[0].startswith("http://127.0.0.1:")
            for port in (base, base + 1):  # each server on cores of its own and its share of the memory
                server = step_of(steps(tmp_path), "env-server", f"--port {port}")
                assert {"--exact", "--cpus-per-task=2", "--mem=2000M"} <= set(server["options"])
                assert "--overlap" not in server["options"]
            assert (logs / "env_servers.yaml").read_text().strip() == f"env.server_urls=[{urls[0]},{urls[1]}]"
            secret = (logs / "env_secret").read_text().strip()
            assert os.stat(logs / "env_secret").st_mode & 0o077 == 0
            for url in urls:
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(url + "/tasks", timeout=10)
                assert refused.value.code == 401
                request = urllib.request.Request(url + "/tasks", headers={"Authorization": f"Bearer {secret}"})
                assert json.load(urllib.request.urlopen(request, timeout=30))
            server = subprocess.run(["pgrep", "-f", f"env-server --env babyai .*--port {base + 1} "],
                                    capture_output=True, text=True).stdout.split()
            os.kill(int(server[0]), signal.SIGKILL)
            deadline = time.monotonic() + 120
            while "restart 1 of 3" not in (logs / "env_servers.log").read_text() and time.monotonic() < deadline:
                time.sleep(1)
            assert f"the server on node-a ({urls[1]}) exited" in (logs / "env_servers.log").read_text()
            while time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(urls[1] + "/health", timeout=5)
                    break
                except OSError:
                    time.sleep(1)
            urllib.request.urlopen(urls[1] + "/health", timeout=5)  # back on its port
        finally:
            fleet.terminate()  # scancel
            fleet.wait(timeout=60)
    left = subprocess.run(["pgrep", "-f", f"env-server --env babyai .*--port ({base}|{base + 1}) "],
                          capture_output=True, text=True).stdout.split()
    assert not left, "the fleet's servers end with the job"


def fixed_port(count: int = 1) -> int:
    """The first of `count` ports free now, below the range the OS picks port-0 binds from (and
    above Ray's worker ports): the scripts bind them later, by number, and no server, rank or Ray
    process of this suite can take them in between, since those all let the OS pick."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lowest_picked = int(f.read().split()[0])
    while True:
        base = random.randrange(20000, lowest_picked - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


def test_a_scaling_sweep_on_slurm_runs_a_job_per_point_with_its_node_count(slurm_env, tmp_path):
    """`scaling --launcher slurm`: the point's job is the launch script on --nodes=2 (a head and a
    node joining it), training its steps; the sweep reports it from the job's metrics."""
    model = tmp_path / "tiny"
    assert run_cli("make-tiny-model", "--out", str(model), "--kv-heads", "2").returncode == 0
    out = tmp_path / "sweep"
    env = slurm_env | {"AGM_DEVICE": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "agentgym_mega.cli", "scaling", "--config", os.path.join("configs", "base.yaml"),
         "--sweep", "nodes=2", "--steps", "2", "--out", str(out), "--launcher", "slurm",
         "--sbatch-arg=--partition=cpu", f"model.path={model}", *TINY_TEXTCRAFT],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    job_log = "".join(p.read_text() for p in (out / "point-1").glob("slurm-*.out"))
    assert result.returncode == 0, result.stderr[-3000:] + job_log[-4000:]
    assert "Submitted batch job 43" in (out / "point-1" / "launch.log").read_text()
    assert {"--nodes=2", "--partition=cpu"} <= set((tmp_path / "sbatch.log").read_text().split())
    assert re.search(r"Ray cluster up at \S+: 2 node\(s\)", job_log)
    assert "--resume auto" in job_log and not (tmp_path / "scontrol.log").exists()  # nothing requeued
    point = json.loads((out / "scaling.json").read_text())["points"][0]
    assert point["exit"] == 0 and point["steps"] == 1 and point["tokens_per_s"] > 0
    assert point["efficiency"] == 1.0 and (out / "scaling.png").is_file()
    assert [m["step"] for m in read_metrics(out / "point-1")] == [1, 2]
