"""Module registration, names, state dicts and grads, as in torch.nn."""

from __future__ import annotations

import numpy as np
import pytest

from minipar.nn import Linear, Module, ModuleList, Parameter
from minipar.nn.module import hook_point


class Tiny(Module):
    def __init__(self):
        super().__init__()
        self.scale = Parameter(np.ones(2))
        self.layers = ModuleList([Linear(2, 3), Linear(3, 2, bias=False)])
        self.not_a_parameter = np.zeros(5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.scale


def test_named_parameters_in_registration_order():
    names = [(n, p.shape) for n, p in Tiny().named_parameters()]
    assert names == [("scale", (2,)), ("layers.0.weight", (2, 3)), ("layers.0.bias", (3,)),
                     ("layers.1.weight", (3, 2))]


def test_swapping_a_submodule_keeps_its_name():
    model = Tiny()
    model.layers[0] = Linear(2, 3, bias=False)
    assert [n for n, _ in model.named_parameters()] == ["scale", "layers.0.weight",
                                                        "layers.1.weight"]
    model.scale = None  # no longer a parameter
    assert "scale" not in dict(model.named_parameters())


def test_shared_parameter_is_listed_once():
    model = Tiny()
    model.alias = model.scale
    assert sum(1 for _ in model.parameters()) == 4


def test_state_dict_is_a_copy_and_round_trips():
    model, other = Tiny(), Tiny()
    other.scale.data[...] = 7.0
    sd = other.state_dict()
    sd["scale"][...] = 3.0  # a copy: the model is unchanged
    assert other.scale.data[0] == 7.0
    model.load_state_dict(sd)
    for (_, a), (_, b) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert a.data is not b.data
    np.testing.assert_array_equal(model.scale.data, [3.0, 3.0])
    x = np.ones((4, 2))
    hidden = x @ sd["layers.0.weight"] + sd["layers.0.bias"]
    np.testing.assert_array_equal(model(x).data, (hidden @ sd["layers.1.weight"]) * 3.0)


def test_load_state_dict_errors_are_clear():
    model = Tiny()
    sd = model.state_dict()
    del sd["scale"]
    sd["extra"] = np.zeros(1)
    with pytest.raises(KeyError, match=r"missing keys \['scale'\].*unexpected keys \['extra'\]"):
        model.load_state_dict(sd)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert missing == ["scale"] and unexpected == ["extra"]
    bad = model.state_dict()
    bad["layers.0.weight"] = np.zeros((3, 2))
    with pytest.raises(ValueError, match=r"layers.0.weight: checkpoint \(3, 2\) vs model \(2, 3\)"):
        model.load_state_dict(bad)


def test_zero_grad_releases_grads_from_the_ledger(device):
    model = Tiny()
    model(np.ones((4, 2))).sum().backward()
    assert device.memory.current["grads"] == sum(p.nbytes for p in
                                                 (q.data for q in model.parameters()))
    model.zero_grad(set_to_none=False)
    assert all(np.all(p.grad == 0) for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert device.memory.current["grads"] == 0


def test_train_eval_propagate():
    model = Tiny()
    model.eval()
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


def test_forgetting_super_init_is_explained():
    class Broken(Module):
        def __init__(self):
            self.w = Parameter(np.ones(1))

    with pytest.raises(AttributeError, match=r"super\(\).__init__\(\)"):
        Broken()


def test_parameters_follow_named_parameters_order():
    model = Tiny()
    assert [id(p) for p in model.parameters()] == [id(p) for _, p in model.named_parameters()]


# ---------------------------------------------------------------- forward hooks
class _Doubler(Module):
    def forward(self, x):
        return 2 * x

    @hook_point
    def embed(self, x):
        return x + 1

    def plain(self, x):
        return x


def test_a_pre_hook_replaces_the_args_and_a_hook_the_output_in_registration_order():
    module, seen = _Doubler(), []
    module.register_forward_pre_hook(lambda m, args: (args[0] + 10,))
    module.register_forward_hook(lambda m, args, out: seen.append((args, out)))
    module.register_forward_hook(lambda m, args, out: out * 100)
    assert module(1) == 2 * 11 * 100
    assert seen == [((11,), 22)]


def test_hooks_wrap_a_declared_hook_point_and_nothing_else():
    module, calls = _Doubler(), []
    handle = module.register_forward_pre_hook(lambda m, args: calls.append("pre"),
                                              method="embed")
    assert module.embed(1) == 2 and module(1) == 2 and calls == ["pre"]
    handle.remove()
    assert module.embed(1) == 2 and calls == ["pre"]
    with pytest.raises(ValueError, match="not a hook point"):
        module.register_forward_hook(lambda m, a, o: None, method="plain")
