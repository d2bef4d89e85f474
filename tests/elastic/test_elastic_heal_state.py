"""``heal.training_state`` on plain modules (one process, no group): the names it lists, and a
model whose parameters are none of the optimizer's refused (what FSDP2 leaves registered after a
step that failed mid-forward; the FSDP2 case itself runs in tests/elastic/test_elastic_torch.py)."""

from __future__ import annotations

import pytest
import torch

from meshgroups.elastic._heal import training_state


def _model_and_adam(frozen: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 2, bias=False))
    if frozen:
        model[0].weight.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_parameters_and_their_optimizer_state_by_name():
    model, opt = _model_and_adam()
    state = training_state(model, opt)
    assert sorted(state) == sorted(
        f"{p}.weight{k}" for p in ("0", "1") for k in ("", ".exp_avg", ".exp_avg_sq", ".step")
    )
    assert state["1.weight.step"].shape == (1,) and state["1.weight.step"].item() == 1
    state["1.weight.exp_avg"].zero_()  # views: writing the state writes the optimizer's
    assert opt.state[model[1].weight]["exp_avg"].abs().sum() == 0


def test_a_frozen_parameter_has_no_state_and_is_not_refused():
    model, opt = _model_and_adam(frozen=True)
    assert sorted(training_state(model, opt)) == [
        "0.weight",
        "1.weight",
        "1.weight.exp_avg",
        "1.weight.exp_avg_sq",
        "1.weight.step",
    ]


def test_a_model_whose_parameters_are_not_the_optimizers_is_refused():
    _owner, opt = _model_and_adam()
    other, _ = _model_and_adam()  # same names and shapes, other objects
    with pytest.raises(
        ValueError, match=r"state for 2 parameter\(s\), none of them one of the model's.*reset_iter_state"
    ):
        training_state(other, opt)
    fresh = torch.optim.Adam(other.parameters())  # no state yet: nothing to miss
    assert sorted(training_state(other, fresh)) == ["0.weight", "1.weight"]


def test_weight_sync_refuses_one_name_on_two_pipeline_stages():
    """What weight sync infers for a dim the mesh does not cover: along the stage dim, the
    weight lives on its stage only; one name on two stages (each with its own values) is two
    weights, which no rollout name can tell apart: refused, never sent from either stage."""
    from meshgroups.transfer import Weight
    from meshgroups.transfer._run.torch_io import merge

    stage0, stage1 = Weight("norm", (4,), stage=("pp", 0)), Weight("norm", (4,), stage=("pp", 1))
    assert merge([[stage0], [stage0]]) == [stage0]
    with pytest.raises(ValueError, match="ranks describe weight 'norm' differently"):
        merge([[stage0], [stage1]])
