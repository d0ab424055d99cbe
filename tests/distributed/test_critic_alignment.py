"""The critic's values reach GAE aligned with the tokens they judge: ``values[:, t]`` is the value
of the state in which token t is chosen (after reading ``input_ids[:, :t]``), checked against
transformers' hidden states through the value head, and then through the estimator on a
hand-built batch where the right alignment and the off-by-one give different advantages."""

import pytest
import torch

from agentgym_mega.platform.local_ranks import run_on_local_ranks

pytestmark = pytest.mark.slow

TOL = 1e-4  # fp32 megatron vs transformers, as the logit parity tests


def critic_job(hf_dir: str, ids: torch.Tensor) -> dict:
    """One rank: a critic whose value head is set to fixed random weights, its values of `ids`."""
    from agentgym_mega import platform
    from agentgym_mega.config import validate
    from agentgym_mega.models.critic import MegatronCritic
    from agentgym_mega.models.weights import unwrap

    platform.init_distributed(tp=1, pp=1, seed=0)
    critic = MegatronCritic(hf_dir, validate({}))
    head = unwrap(critic.model).output_layer  # ValueHead: weight [1, hidden], bias [1]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator))
        head.bias.fill_(0.25)
    return {"values": critic.values(ids), "weight": head.weight.detach().clone(), "bias": 0.25}


@pytest.fixture(scope="module")
def run(megatron_models):
    from transformers import AutoModelForCausalLM

    hf_dir = megatron_models["qwen2"]
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    out = run_on_local_ranks(critic_job, 1, hf_dir, ids)[0]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state  # after the final norm, what the head reads
    head_at = hidden @ out["weight"].T + out["bias"]  # [B, T, 1]: value after reading ids[:, :t+1]
    return out["values"], head_at.squeeze(-1)


def test_values_are_of_the_state_before_each_token(run):
    values, head_at = run
    assert values.shape == head_at.shape
    assert torch.all(values[:, 0] == 0)  # nothing is chosen at position 0
    assert (values[:, 1:] - head_at[:, :-1]).abs().max() < TOL
    assert (values[:, 1:] - head_at[:, 1:]).abs().max() > 100 * TOL  # the off-by-one is visible


def test_gae_through_critic_values_uses_the_aligned_values(run):
    from agentgym_mega.algorithms import compute_advantages
    from agentgym_mega.config import AlgorithmConfig
    from agentgym_mega.rollout.batch import Episode, TrajectoryBatch
    from agentgym_mega.rollout.status import Status

    values, head_at = run
    # prompt 0-2, a reply at 3-4, an observation 5-6, a reply at 7-8, padding 9 (row 0);
    # row 1 replies at 2-5 only. The terminal reward sits on each row's last reply token.
    mask = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float)
    rewards = torch.zeros(2, 10)
    rewards[0, 8], rewards[1, 5] = 1.0, 0.5
    episodes = [Episode(0, "", i, float(rewards[i].sum()), True, 2, Status.DONE, int(mask[i].sum())) for i in range(2)]
    batch = TrajectoryBatch(
        input_ids=torch.zeros(2, 10, dtype=torch.long), attention_mask=torch.ones(2, 10, dtype=torch.long),
        loss_mask=mask, rollout_logprobs=torch.zeros(2, 10), rewards=rewards, group_ids=torch.tensor([0, 1]),
        scores=rewards.sum(-1), episodes=episodes, values=values,
    )
    compute_advantages(batch, AlgorithmConfig(estimator="gae", gamma=1.0, lam=1.0))

    def by_hand(v):
        # gamma = lambda = 1: each trained token's advantage is the episode's return minus the
        # value of the state it was chosen in (the deltas telescope over the trained tokens).
        expected = torch.zeros(2, 10)
        for row, ret in ((0, 1.0), (1, 0.5)):
            for t in mask[row].nonzero().flatten().tolist():
                expected[row, t] = ret - v[row, t]
        return expected

    aligned = by_hand(torch.nn.functional.pad(head_at[:, :-1], (1, 0)))  # V(ids[:, :t])
    off_by_one = by_hand(head_at)  # V(ids[:, :t+1]): the value after the token was chosen
    torch.testing.assert_close(batch.advantages, aligned, atol=TOL, rtol=0)
    assert (batch.advantages - off_by_one).abs().max() > 100 * TOL
    torch.testing.assert_close(batch.returns, (aligned + values) * mask, atol=TOL, rtol=0)
