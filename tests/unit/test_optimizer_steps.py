"""Restoring Adam's step count after megatron loads an optimizer checkpoint, for torch's Adam
(count per parameter) and for the fused optimizers GPU runs use (count in the param group)."""

import types

import torch

from agentgym_mega.models.checkpoint import _restore_adam_steps


def _params():
    return [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]


def test_torch_adam_gets_one_step_tensor_per_parameter_holding_the_saved_count():
    params = _params()
    adam = torch.optim.Adam(params)
    sum(p.sum() for p in params).backward()
    adam.step()
    # What megatron-core leaves after loading a checkpoint saved at step 5: the count in the
    # group, one pre-load tensor shared by every parameter.
    shared = torch.tensor(1.0)
    adam.param_groups[0]["step"] = 5
    for p in params:
        adam.state[p]["step"] = shared
    _restore_adam_steps(types.SimpleNamespace(optimizer=adam))
    steps = [adam.state[p]["step"] for p in params]
    assert [s.item() for s in steps] == [5.0, 5.0]
    assert steps[0] is not steps[1]


class GroupStepAdam(torch.optim.Optimizer):
    """The state layout of Transformer Engine's (and Apex's) FusedAdam, which CI cannot install:
    moments per parameter, the step count only in the param group."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("exp_avg", torch.zeros_like(p)).add_(p.grad)
                state.setdefault("exp_avg_sq", torch.zeros_like(p)).add_(p.grad ** 2)


def test_fused_adam_keeps_its_count_in_the_group_and_gains_no_per_parameter_step():
    params = _params()
    fused = GroupStepAdam(params)
    sum(p.sum() for p in params).backward()
    fused.step()
    fused.param_groups[0]["step"] = 7  # as megatron restores it from the checkpoint
    chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=fused)])
    _restore_adam_steps(chained)
    assert fused.param_groups[0]["step"] == 7
    assert all(set(fused.state[p]) == {"exp_avg", "exp_avg_sq"} for p in params)
