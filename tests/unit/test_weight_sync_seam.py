"""The weight-sync seam: nothing outside weight_sync/ imports a concrete transport (checked on
the sources' import statements, function-level ones included), receivers survive the dict form
they reach vLLM workers in, and every synchronizer asks for an export form the trainer has."""

import ast
import pathlib

import pytest

from agentgym_mega.models.weights import EXPORT_TO
from agentgym_mega.weight_sync import SyncError, receiver_of
from agentgym_mega.weight_sync.collective import CollectiveJoin, CollectiveWeightSynchronizer
from agentgym_mega.weight_sync.cuda_ipc import CudaIpcWeightSynchronizer
from agentgym_mega.weight_sync.zmq_transport import ZmqReceiver, ZmqWeightSynchronizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "agentgym_mega.weight_sync"
# What code outside the package may import: the package itself (its interface and factory), the
# interface, the factory, and the loopback harness `bench sync` times the raw transports with.
PUBLIC = {PACKAGE, f"{PACKAGE}.base", f"{PACKAGE}.factory", f"{PACKAGE}.loopback"}


SUBMODULES = {p.stem for p in (ROOT / "agentgym_mega" / "weight_sync").glob("*.py")} - {"__init__"}


def transport_imports(source: str) -> list[str]:
    """The weight_sync modules `source` imports beyond PUBLIC (as `import x.y`, `from x.y import
    z`, or `from agentgym_mega.weight_sync import <submodule>`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            if node.module == PACKAGE:
                modules += [f"{PACKAGE}.{a.name}" for a in node.names if a.name in SUBMODULES]
        else:
            continue
        found += [m for m in modules if m.startswith(PACKAGE) and m not in PUBLIC]
    return found


def test_the_check_sees_every_form_of_import():
    assert transport_imports("import agentgym_mega.weight_sync.collective as c") == [f"{PACKAGE}.collective"]
    assert transport_imports("def f():\n    from agentgym_mega.weight_sync.zmq_sender import endpoint\n") \
        == [f"{PACKAGE}.zmq_sender"]
    assert transport_imports("from agentgym_mega.weight_sync import cuda_ipc, SyncError") == [f"{PACKAGE}.cuda_ipc"]
    assert transport_imports("from agentgym_mega.weight_sync import SyncError, for_trainer_rank\n"
                             "from agentgym_mega.weight_sync.factory import device_buckets") == []


def test_nothing_outside_weight_sync_imports_a_concrete_transport():
    sources = [p for folder in ("agentgym_mega", "envs", "checkpoint_tools") for p in (ROOT / folder).rglob("*.py")
               if (ROOT / "agentgym_mega" / "weight_sync") not in p.parents]
    assert len(sources) > 50
    offenders = {str(p.relative_to(ROOT)): found for p in sources if (found := transport_imports(p.read_text()))}
    assert offenders == {}, "import these through agentgym_mega.weight_sync (base / factory) instead"


@pytest.mark.parametrize("receiver", [
    ZmqReceiver(4, "ipc:///tmp/x/{uuid}.sock", 30.0, "s" * 64),
    ZmqReceiver(5, "ipc:///tmp/x/sock", 1.5),
    CollectiveJoin(6, {"id": "g", "stores": [["10.0.0.1", 29500]], "world": 3}, 1, "s" * 64),
])
def test_a_receiver_survives_its_dict_form(receiver):
    assert receiver_of(receiver.as_dict()) == receiver


def test_an_unknown_receiver_is_named():
    with pytest.raises(SyncError, match="unknown weight-sync receiver 'carrier-pigeon'"):
        receiver_of({"kind": "carrier-pigeon", "version": 1})


def test_every_synchronizer_asks_for_an_export_the_trainer_has():
    forms = {cls.export for cls in (ZmqWeightSynchronizer, CollectiveWeightSynchronizer, CudaIpcWeightSynchronizer)}
    assert forms == set(EXPORT_TO)


def test_a_rank_that_does_not_send_still_drains_its_export():
    drained = []

    def export():
        for i in range(3):
            drained.append(i)
            yield f"t{i}", None

    synchronizer = ZmqWeightSynchronizer(sends=False)
    assert synchronizer.sync(export(), engines=[object()], version=1) is None
    assert drained == [0, 1, 2]
    synchronizer.close()
