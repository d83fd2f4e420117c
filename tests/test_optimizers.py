"""LAMB and LARS (dtprobe.runtime.optimizers) on one process: two steps of each against values worked out by hand,
the 1-D parameters' group (no weight decay, no trust ratio), the factory and config, and a DCP checkpoint round
trip of their state (the runtime.checkpoint pattern of tests/test_checkpoint.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dtprobe.runtime.checkpoint import CheckpointConfig, Checkpointer, TrainState
from dtprobe.runtime.config import JobConfig, TrainConfig
from dtprobe.runtime.model import build_model
from dtprobe.runtime.optimizers import LAMB, LARS, build_optimizer, optimizer_kwargs, param_groups
from dtprobe.store.errors import ConfigError


def _linear() -> nn.Linear:
    """weight [[3, 4]] (norm 5, a matrix: trust ratio and weight decay), bias [1] (1-D: neither)."""
    layer = nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[3.0, 4.0]]))
        layer.bias.copy_(torch.tensor([1.0]))
    return layer


def _two_steps(layer: nn.Linear, opt: torch.optim.Optimizer) -> list[tuple[list[float], float]]:
    """Gradients set by hand: weight [0.6, -0.8] (norm 1) then [0.2, 0.4]; bias 0.5 both times."""
    out = []
    for grad in ([[0.6, -0.8]], [[0.2, 0.4]]):
        layer.weight.grad = torch.tensor(grad)
        layer.bias.grad = torch.tensor([0.5])
        opt.step()
        out.append((layer.weight.detach().flatten().tolist(), float(layer.bias.detach())))
    return out


def test_lamb_steps_match_the_hand_computed_update_with_trust_ratio_and_bias_correction():
    layer = _linear()
    opt = build_optimizer(layer.parameters(), name="lamb", lr=0.1, betas=(0.9, 0.99), eps=0.0, weight_decay=0.1)
    (w1, b1), (w2, b2) = _two_steps(layer, opt)
    # Step 1: m_hat = g, v_hat = g^2, so r = sign(g) = [1, -1]; u = r + 0.1 * [3, 4] = [1.3, -0.6];
    # trust = ||w|| / ||u|| = 5 / sqrt(2.05) = 3.492151; w = [3, 4] - 0.1 * 3.492151 * [1.3, -0.6].
    assert w1 == pytest.approx([2.5460203, 4.2095291], abs=1e-6)
    # Step 2: m = [0.074, -0.032], v = [0.003964, 0.007936]; bias-corrected by 0.19 and 0.0199:
    # r = [0.8726455, -0.2666994], u = r + 0.1 * w1 = [1.1272475, 0.1542535], trust = ||w1|| / ||u|| = 4.323953.
    assert w2 == pytest.approx([2.0586038, 4.1428306], abs=1e-6)
    # Bias: Adam's step alone, r = 1 both times (with a trust ratio |b| / |r| the second step would give 0.81).
    assert (b1, b2) == pytest.approx((0.9, 0.8), abs=1e-6)
    state = opt.state[layer.weight]
    assert float(state["step"]) == 2 and state["exp_avg"].flatten().tolist() == pytest.approx([0.074, -0.032])


def test_lars_steps_match_the_hand_computed_update_with_momentum_and_local_lr():
    layer = _linear()
    opt = build_optimizer(layer.parameters(), name="lars", lr=1.0, momentum=0.9, weight_decay=0.01)
    (w1, b1), (w2, b2) = _two_steps(layer, opt)
    # Step 1: local lr = 0.001 * 5 / (1 + 0.01 * 5) = 0.0047619; d = g + 0.01 w = [0.63, -0.76];
    # buf = 0.0047619 * d = [0.003, -0.0036190]; w = [2.997, 4.0036190].
    assert w1 == pytest.approx([2.997, 4.0036190], abs=1e-6)
    # Step 2: ||w1|| = 4.9999, ||g|| = sqrt(0.2): local lr = 0.0100580; buf = 0.9 * buf + 0.0100580 * (g + 0.01 w1).
    assert w2 == pytest.approx([2.9919870, 4.0024503], abs=1e-6)
    # Bias: plain momentum SGD (buf 0.5, then 0.9 * 0.5 + 0.5).
    assert (b1, b2) == pytest.approx((0.5, -0.45), abs=1e-6)


@pytest.mark.parametrize("cls,kwargs", [(LAMB, {"lr": 0.1}), (LARS, {"lr": 1.0})])
def test_trust_ratio_is_one_when_the_weight_is_zero(cls, kwargs):
    """A zero weight (e.g. a zero-initialised projection) takes the unscaled step instead of none at all."""
    w = nn.Parameter(torch.zeros(2, 2))
    w.grad = torch.full((2, 2), 0.5)
    cls([w], **kwargs).step()
    expected = -kwargs["lr"] * (1.0 if cls is LAMB else 0.5)   # LAMB: sign(g); LARS: lr * g
    assert torch.allclose(w.detach(), torch.full((2, 2), expected))


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_param_groups_exclude_biases_and_norm_weights_from_decay_and_trust_ratio(name):
    model = build_model("tiny", seed=0)
    groups = param_groups(model.parameters(), name=name)
    matrices, vectors = groups
    assert all(p.ndim == 2 for p in matrices["params"]) and "weight_decay" not in matrices
    assert all(p.ndim == 1 for p in vectors["params"])
    assert vectors["weight_decay"] == 0.0 and vectors["trust_ratio"] is False
    names = {id(p): n for n, p in model.named_parameters()}
    excluded = {names[id(p)] for p in vectors["params"]}
    assert "blocks.0.ln1.weight" in excluded and "blocks.0.attn.q.bias" in excluded
    assert "blocks.0.attn.q.weight" not in excluded
    assert len(matrices["params"]) + len(vectors["params"]) == len(list(model.parameters()))
    opt = build_optimizer(model.parameters(), name=name, **optimizer_kwargs(TrainConfig(optimizer=name)))
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0


def test_adamw_keeps_one_group_with_decay_on_every_parameter():
    model = build_model("tiny", seed=0)
    opt = build_optimizer(model.parameters(), name="adamw", **optimizer_kwargs(TrainConfig()))
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == 1
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["weight_decay"] == 0.1


def test_optimizer_config_rejects_an_unknown_name_with_the_choices():
    with pytest.raises(ConfigError, match=r"train.optimizer = 'sgd'.*--optimizer.*'adamw', 'lamb', 'lars'"):
        JobConfig.from_dict({"train": {"optimizer": "sgd"}})
    assert JobConfig.from_dict({"train": {"optimizer": "lars"}}).train.optimizer == "lars"
    with pytest.raises(ConfigError, match="train.optimizer = 'sgd'"):
        build_optimizer([nn.Parameter(torch.ones(2, 2))], name="sgd", lr=1.0)


@pytest.mark.parametrize("name,lr", [("lamb", 0.01), ("lars", 1.0)])
def test_optimizer_state_round_trips_through_a_dcp_checkpoint(tmp_path, name, lr):
    """Save after two steps, load into a fresh model and optimizer: the state and the next step are identical."""
    def state(seed: int) -> TrainState:
        model = build_model("tiny", seed=seed)
        return TrainState(model, build_optimizer(model.parameters(), name=name, lr=lr, weight_decay=0.1))

    def step(st: TrainState, seed: int) -> None:
        x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
        st.model(x).float().mean().backward()
        st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)

    ck = Checkpointer(CheckpointConfig(every=1, keep=0), tmp_path, rank=0, world_size=1, is_leader=True,
                      record=lambda table, row: None, fault=lambda kind, **kw: None)
    saved = state(1)
    step(saved, 0)
    step(saved, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # DCP warns that it runs without a process group
        ck.save(saved, step=1)
        fresh = state(2)
        assert ck.load_latest(fresh) == 1
    key = "exp_avg_sq" if name == "lamb" else "momentum_buffer"
    for p_saved, p_fresh in zip(saved.model.parameters(), fresh.model.parameters()):
        assert torch.equal(p_saved, p_fresh)
        assert torch.equal(saved.optimizer.state[p_saved][key], fresh.optimizer.state[p_fresh][key])
    assert [g["weight_decay"] for g in fresh.optimizer.param_groups] == [0.1, 0.0]
    step(saved, 2)
    step(fresh, 2)
    assert all(torch.equal(a, b) for a, b in zip(saved.model.parameters(), fresh.model.parameters()))


@pytest.mark.parametrize("cls", [LAMB, LARS])
def test_step_with_a_closure_returns_its_loss_and_uses_the_gradients_it_makes(cls):
    w = nn.Parameter(torch.tensor([[3.0, 4.0]]))
    opt = cls([w], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (w ** 2).sum()
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) == 25.0
    assert float(w.detach().norm()) < 5.0       # stepped along the closure's gradient 2w, towards 0
