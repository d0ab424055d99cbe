"""The fused log-prob and entropy head (models/actor.py) against plain torch on the whole
vocabulary: values and gradients, with temperature and vocabulary padding, at TP=1 and TP=2
(each rank holding half of the padded vocabulary, in megatron's sequence-first order); also
with a loss using the log-probs only (the entropy's gradient terms skipped), computed only at
chosen positions (0 elsewhere, and no gradient from there), and at temperature 1, where fp32
logits are read in place and must be left as they were. Tolerance 1e-5 (fp32). The log-probs
alone (the no-gradient pass of the old and reference policies) must equal the fused head's
bit for bit, bf16 logits included, and leave the logits as they were."""

import pytest
import torch

from agentgym_mega.platform.local_ranks import run_on_local_ranks

VOCAB, PADDED, TEMPERATURE = 100, 128, 0.7


def inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, PADDED, generator=g) * 3
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    weights = torch.randn(2, 3, 9, generator=g)
    positions = torch.rand(3, 9, generator=g) < 0.4
    return logits, ids, weights, positions


CASES = ("both", "logp_only", "positions", "unscaled")


def temperature(case: str) -> float:
    return 1.0 if case == "unscaled" else TEMPERATURE  # at 1 the head reads fp32 logits in place


def head_job(tp: int, case: str) -> dict:
    from megatron.core import parallel_state

    from agentgym_mega import platform
    from agentgym_mega.models.actor import token_logprobs_and_entropy

    platform.init_distributed(tp=tp, pp=1, seed=0)
    logits, ids, weights, positions = inputs()
    rank, shard = parallel_state.get_tensor_model_parallel_rank(), PADDED // tp
    # megatron's sequence-first order, [T, b, V / tp]
    mine = logits.transpose(0, 1)[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
    before = mine.detach().clone()
    logp, entropy = token_logprobs_and_entropy(mine, ids, VOCAB, temperature(case),
                                               positions if case == "positions" else None)
    loss = (logp * weights[0]).sum()
    if case != "logp_only":
        loss = loss + (entropy * weights[1]).sum()
    loss.backward()
    assert torch.equal(mine.detach(), before), "the head wrote into the logits"
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad": mine.grad.transpose(0, 1)}


def reference(case: str) -> dict:
    logits, ids, weights, positions = inputs()
    logits = logits.requires_grad_()
    log_p = torch.log_softmax(logits[..., :VOCAB] / temperature(case), dim=-1)[:, :-1]
    logp = torch.nn.functional.pad(log_p.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    entropy = torch.nn.functional.pad(-(log_p.exp() * log_p).sum(-1), (1, 0))
    if case == "positions":  # position 0 has no prediction: it is never computed
        keep = positions & (torch.arange(9) > 0)
        logp, entropy = logp * keep, entropy * keep
    loss = (logp * weights[0]).sum() + (0 if case == "logp_only" else (entropy * weights[1]).sum())
    loss.backward()
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad": logits.grad}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_head_matches_log_softmax_and_its_gradients(tp, case):
    want = reference(case)
    ranks = run_on_local_ranks(head_job, tp, tp, case)
    if case == "positions":  # half the positions unset, so the zeros and the gradient gaps are tested
        unset = ~inputs()[3]
        assert unset[:, 1:].any() and (want["logp"][unset] == 0).all() and want["logp"].abs().max() > 0.1
    for rank, got in enumerate(ranks):
        for key in ("logp", "entropy"):
            assert torch.allclose(got[key], want[key], atol=1e-5, rtol=1e-5), (key, (got[key] - want[key]).abs().max())
        shard = PADDED // tp
        expected = want["grad"][..., rank * shard:(rank + 1) * shard]
        assert torch.allclose(got["grad"], expected, atol=1e-5, rtol=1e-5), (got["grad"] - expected).abs().max()
    assert want["grad"][..., VOCAB:].abs().max() == 0 and want["grad"].abs().max() > 0.1


ALONE_CASES = ("scaled", "positions", "unscaled", "bf16")


def alone_job(tp: int) -> dict:
    from megatron.core import parallel_state

    from agentgym_mega import platform
    from agentgym_mega.models.actor import token_logprobs, token_logprobs_and_entropy

    platform.init_distributed(tp=tp, pp=1, seed=0)
    logits, ids, _, positions = inputs()
    rank, shard = parallel_state.get_tensor_model_parallel_rank(), PADDED // tp
    out = {}
    for case in ALONE_CASES:  # one set of ranks for all: each start costs seconds
        mine = logits.transpose(0, 1)[..., rank * shard:(rank + 1) * shard].contiguous()
        mine = mine.bfloat16() if case == "bf16" else mine
        before = mine.clone()
        args = (mine, ids, VOCAB, 1.0 if case in ("unscaled", "bf16") else TEMPERATURE,
                positions if case == "positions" else None)
        with torch.no_grad():
            out[case] = {"alone": token_logprobs(*args), "fused": token_logprobs_and_entropy(*args)[0]}
        assert torch.equal(mine, before), f"{case}: the head wrote into the logits"
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_alone_equal_the_fused_heads(tp):
    ranks = run_on_local_ranks(alone_job, tp, tp)
    for case in ALONE_CASES:
        want = None if case == "bf16" else reference({"scaled": "both"}.get(case, case))["logp"]
        for got in (rank[case] for rank in ranks):
            assert torch.equal(got["alone"], got["fused"]), (case, (got["alone"] - got["fused"]).abs().max())
            if want is not None:  # bf16: the fused head's own values are the reference
                error = (got["alone"] - want).abs().max()
                assert torch.allclose(got["alone"], want, atol=1e-5, rtol=1e-5), (case, error)
