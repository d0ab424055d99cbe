"""Start-up that scales: a rank allocates and reads only its shard of the weights, and a
checkpoint written on megatron's local layer spec (CPU) names its tensors as the Transformer
Engine spec (GPU) does, so one loads on the other."""

import pytest
import torch

from agentgym_mega.bench import startup
from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed import megatron_jobs as jobs

pytestmark = pytest.mark.slow


def test_each_of_two_tp_ranks_loads_in_at_most_60_percent_of_one_ranks_memory(model_100m):
    """Host memory a rank's start-up adds (peak RSS over RSS before; see bench/startup.py) for a
    ~95M-parameter model. Reading whole HF tensors and building full-size matrices measured 0.65-0.75;
    slice reads written straight into the parameters and no random initialisation, 0.51."""
    single = startup.measure(model_100m, 1)[0]
    pair = startup.measure(model_100m, 2)
    for rank in pair:
        assert rank["params_mb"] == pytest.approx(single["params_mb"] / 2, rel=0.01)
        assert rank["load_mb"] <= 0.6 * single["load_mb"], (rank, single)
    assert single["on_device"] and all(rank["on_device"] for rank in pair)
    # the shard itself is most of what loading holds at its peak
    assert single["load_mb"] <= 1.3 * single["params_mb"], single


def _te_checkpoint_names(hf_config) -> set[str]:
    """The TE spec's parameter names in a dist-checkpoint: layers stacked under one key each."""
    from agentgym_mega.models import mapping

    names = set()
    for rule in mapping.rules(hf_config, te_spec=True):
        if rule.exported:  # a tied LM head is the embedding, saved once
            names.add(rule.megatron.replace(mapping.LAYER + ".", ""))
    return names


def checkpoint_names_job(models: dict, root: str) -> dict:
    from megatron.core import dist_checkpointing

    from agentgym_mega import platform
    from agentgym_mega.models.actor import MegatronActor

    platform.init_distributed(tp=1, pp=1, seed=0)
    out = {}
    for arch, hf_dir in models.items():
        actor = MegatronActor(hf_dir, jobs.make_config(1, 1, 1))
        actor.update({"input_ids": jobs.tokens(actor.hf_config.vocab_size)}, jobs.sft_loss)
        path = actor.save_checkpoint(f"{root}/{arch}", step=1)
        saved = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
        fresh = MegatronActor(hf_dir, jobs.make_config(1, 1, 1), load_weights=False)
        fresh.load_checkpoint(path)
        out[arch] = {
            "keys": sorted(k for k in dist_checkpointing.load_tensors_metadata(path) if not k.startswith("optimizer.")),
            "te_names": sorted(_te_checkpoint_names(actor.hf_config)),
            "reloaded_equal": all(torch.equal(saved[n], p) for n, p in fresh.model.named_parameters()),
        }
    return out


def test_local_spec_checkpoints_carry_the_te_spec_names_and_load_back(megatron_models, tmp_path):
    out = run_on_local_ranks(checkpoint_names_job, 1, megatron_models, str(tmp_path))[0]
    for arch, res in out.items():
        assert res["keys"] == res["te_names"], arch
        assert any("layer_norm_weight" in k for k in res["keys"])
        assert res["reloaded_equal"], arch
