"""Weight-sync topology: no process group weight sync forms holds two members on one (node, GPU),
for every recipe, every layout `plan` suggests, and every launch example in the docs; `auto`
follows the layout (colocated engines are fed per GPU on any number of nodes, engines on GPUs of
their own join a collective); what a layout cannot carry is refused in words that name it."""

import glob
import os
import re
import shlex

import pytest

from agentgym_mega import memory_plan
from agentgym_mega.cli.plan import sync_groups as plan_groups
from agentgym_mega.config import load_config
from agentgym_mega.errors import BadInput
from agentgym_mega.weight_sync import SyncError, SyncLayout, choose_transport, planned_layout, sync_groups
from agentgym_mega.weight_sync.topology import PROCESS_GROUPS, check

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(REPO, "configs", "recipes", "*.yaml")))
DOCS = [os.path.join(REPO, "slurm", "README.md"), os.path.join(REPO, "README.md"),
        *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
GPUS_PER_NODE = 8


def layout_of(cfg, gpus_per_node: int = GPUS_PER_NODE) -> SyncLayout:
    return planned_layout(cfg.parallel.world_size, cfg.parallel.pp, cfg.rollout.num_engines, cfg.rollout.engine_tp,
                          cfg.cluster.placement == "colocated", gpus_per_node)


def assert_invariant(cfg, gpus_per_node: int = GPUS_PER_NODE) -> list:
    """The groups `cfg`'s sync forms on GPUs: no process group holds a GPU twice, every engine
    worker is reached exactly once per stage, the trainer ranks have a GPU each."""
    layout = layout_of(cfg, gpus_per_node)
    transport = choose_transport(cfg.weight_sync.transport, layout, cuda=True)
    groups = sync_groups(transport, layout, cuda=True)
    for group in groups:
        if group.backend in PROCESS_GROUPS:
            assert not group.shared_devices(), (group.name, group.shared_devices())
    assert len({m.device for m in layout.trainer}) == len(layout.trainer)
    reached = [m for g in groups for m in g.members[1:]]
    stages = cfg.parallel.pp if transport == "collective" else 1
    assert sorted(m.role for m in reached) == sorted(w.role for w in layout.workers) * stages
    return groups


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_every_recipe_forms_no_group_with_a_gpu_twice(recipe):
    cfg = load_config(recipe, [])
    groups = assert_invariant(cfg)
    layout = layout_of(cfg)
    if cfg.cluster.placement == "colocated":
        # colocated, one node or eight: each worker is fed by the trainer rank on its own GPU
        assert {g.backend for g in groups} == {"cuda_ipc"}
        assert all(len({m.device for m in g.members}) == 1 for g in groups)
        assert len(groups) == len({w.device for w in layout.workers})


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_plan_json_lists_the_groups_of_every_recipe(recipe):
    cfg = load_config(recipe, [])
    listed = plan_groups(cfg, GPUS_PER_NODE)
    assert listed and listed == [g.as_dict() for g in assert_invariant(cfg)]
    for group in listed:
        assert set(group) == {"name", "backend", "members"}
        assert all(set(m) == {"node", "gpu", "role"} and 0 <= m["gpu"] < GPUS_PER_NODE for m in group["members"])


def test_a_multi_node_colocated_recipe_no_longer_puts_a_sender_and_its_gpus_engine_in_one_group():
    cfg = load_config(os.path.join(REPO, "configs", "recipes", "textcraft_llama-3.1-70b.yaml"), [])
    layout = layout_of(cfg)
    assert layout.colocated and layout.remote  # 8 nodes: the old rule picked the collective here
    with pytest.raises(SyncError, match="weight-sync group stage 0 \\(nccl\\) would hold trainer rank 0 and engine 0 "
                                        "worker 0, all on node 0 GPU 0: NCCL refuses"):
        choose_transport("collective", layout, cuda=True)
    assert choose_transport("auto", layout, cuda=True) == "cuda_ipc"


def test_the_layouts_plan_suggests_keep_the_invariant():
    fourteen_b = os.path.join(REPO, "configs", "recipes", "textcraft_qwen2.5-14b.yaml")
    cfg = load_config(fourteen_b, ["trainer.max_tokens_per_gpu=200000"])  # far too much activation memory
    hf, source = memory_plan.read_architecture(cfg.model)
    result = memory_plan.plan(cfg, hf, GPUS_PER_NODE, 80.0, None, source)
    assert not result["fits"] and result["nearest"]
    for nearest in result["nearest"]:
        assert_invariant(load_config(fourteen_b, ["trainer.max_tokens_per_gpu=200000", *nearest["overrides"]]))


def launch_examples() -> list[tuple[str, list[str]]]:
    """Every `sbatch ... slurm/train_scalinginter.sh CONFIG [overrides]` in the docs."""
    found = []
    for path in DOCS:
        text = open(path).read().replace("\\\n", " ")
        for line in re.findall(r"sbatch [^\n`]*slurm/train_scalinginter\.sh [^\n`]*", text):
            words = shlex.split(line.split("#")[0])
            args = words[words.index("slurm/train_scalinginter.sh") + 1:]
            found.append((os.path.relpath(path, REPO), args))
    return found


EXAMPLES = launch_examples()


def test_the_docs_hold_launch_examples():
    assert any(p == "slurm/README.md" and "parallel.world_size=16" in a for p, a in EXAMPLES)  # the two-node one


@pytest.mark.parametrize("doc,args", EXAMPLES, ids=[f"{p}:{' '.join(a)[:40]}" for p, a in EXAMPLES])
def test_every_launch_example_forms_no_group_with_a_gpu_twice(doc, args):
    config = args[0] if args[0].endswith(".yaml") else os.path.join("configs", f"{args[0]}_scalinginter.yaml")
    overrides = [a for a in args[1:] if "=" in a and not a.startswith("[") and "..." not in a]
    assert_invariant(load_config(os.path.join(REPO, config), overrides))


@pytest.mark.parametrize("colocated,gpus_per_node,cuda,expected,backends", [
    (True, 8, True, "cuda_ipc", {"cuda_ipc"}),  # one GPU node
    (True, 2, True, "cuda_ipc", {"cuda_ipc"}),  # two GPU nodes
    (True, 4, False, "ipc", {"zmq"}),  # one CPU node: rank 0's stream, no full export on every rank
    (True, 2, False, "cuda_ipc", {"host_ipc"}),  # logical GPUs over two CPU nodes stand in for the GPU path
    (False, 8, True, "collective", {"nccl"}),  # engines on GPUs of their own, one node (was a stranded cuda_ipc)
    (False, 2, False, "collective", {"gloo"}),
    (False, 8, False, "ipc", {"zmq"}),
])
def test_auto_follows_the_layout(colocated, gpus_per_node, cuda, expected, backends):
    layout = planned_layout(4, 2, 4, 1, colocated, gpus_per_node)
    assert choose_transport("auto", layout, cuda) == expected
    groups = sync_groups(expected, layout, cuda)
    assert {g.backend for g in groups} == backends
    check(groups)


def test_the_collective_has_one_group_per_stage_sent_by_tp_rank_0_of_the_first_replica():
    layout = planned_layout(16, 2, 2, 2, False, 8)  # TP 4 x DP 2 x PP 2: stage 1 starts at rank 8
    groups = sync_groups("collective", layout, cuda=True)
    assert [g.members[0].role for g in groups] == ["trainer rank 0", "trainer rank 8"]
    assert [m.device for m in groups[1].members] == [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3)]


@pytest.mark.parametrize("transport,colocated,gpus_per_node,error", [
    ("ipc", True, 2, "ipc reaches engines on trainer rank 0's node only, but engine workers run on node\\(s\\) 1"),
    ("cuda_ipc", False, 8, "engine 0 worker 0, engine 1 worker 0, engine 2 worker 0, engine 3 worker 0 share\\(s\\) "
                           "no GPU with a trainer rank"),
    ("collective", True, 8, "would hold trainer rank 0 and engine 0 worker 0, all on node 0 GPU 0"),
])
def test_a_layout_a_transport_cannot_carry_is_named(transport, colocated, gpus_per_node, error):
    with pytest.raises(SyncError, match=error):
        choose_transport(transport, planned_layout(4, 1, 4, 1, colocated, gpus_per_node), cuda=True)


def test_the_plan_refuses_a_collective_that_would_hold_a_gpu_twice():
    seven_b = os.path.join(REPO, "configs", "recipes", "babyai_qwen2.5-7b.yaml")
    cfg = load_config(seven_b, ["weight_sync.transport=collective"])
    hf, source = memory_plan.read_architecture(cfg.model)
    with pytest.raises(BadInput, match="NCCL refuses a communicator with one GPU twice"):
        result = memory_plan.plan(cfg, hf, GPUS_PER_NODE, 80.0, None, source)
        if not result["fits"]:
            raise BadInput(result["reason"])


def test_gpu_uuids_on_named_nodes_place_the_same_way():
    # at run time devices are UUIDs (unique), placed on the Ray node that reported them
    layout = SyncLayout.of(["GPU-a", "GPU-b"], ["GPU-b", "GPU-c"], 1, 1, nodes=["n1", "n1", "n1", "n2"])
    assert not layout.colocated and layout.remote
    with pytest.raises(SyncError, match="engine 1 worker 0 share\\(s\\) no GPU"):
        choose_transport("cuda_ipc", layout, cuda=True)
    assert choose_transport("auto", layout, cuda=True) == "collective"  # rank 0 (GPU-a) shares no GPU
    # a worker on the sender's GPU next to one on a GPU of its own: no transport carries both
    mixed = SyncLayout.of(["GPU-a", "GPU-b"], ["GPU-a", "GPU-c"], 1, 1, nodes=["n1", "n1", "n1", "n2"])
    with pytest.raises(SyncError, match="would hold trainer rank 0 and engine 0 worker 0, all on node n1 GPU GPU-a"):
        choose_transport("auto", mixed, cuda=True)
