"""`Module`, `ModuleList` and `Parameter`, shaped like `torch.nn`.

Assigning a `Parameter` or a `Module` to an attribute registers it under that name, so
`named_parameters()` yields dotted paths ("h.0.attn.c_attn.weight") that are the keys of
`state_dict()`. Registered children are plain attributes, so the hot path reads them at
full speed, and later code can swap one for another (`block.attn.c_attn =
ColumnParallelLinear(...)`) and the new one is registered under the same name.

Forward hooks, as `torch.nn.Module`'s: a pre-hook runs before a call, `hook(module, args)`,
and may return new args; a hook runs after it, `hook(module, args, output)`, and may
return a new output. ZeRO-3 gathers a module's parameters in one and frees them in the
other (PyTorch FSDP and DeepSpeed stage 3 register the same pair). Besides `forward`,
a class may declare other methods that hooks can wrap with `@hook_point` (GPT's `embed`
and `head`, which a pipeline stage calls on their own): the class says where the model
can be wrapped, so nothing is patched on an instance.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import numpy as np

from minipar.autograd.placement import Replicate
from minipar.autograd.tensor import Tensor


class Parameter(Tensor):
    """A leaf Tensor that is a trainable weight (requires grad by default).

    `placement` says how this rank's `data` relates to the full single-device weight over
    the group of kind `placement_group` ("tp", "dp", ...): see minipar.autograd.placement.
    A plain single-device parameter is `Replicate()` over no group. `grad_category` is
    the memory-ledger category its `.grad` is booked under when backward creates it.
    `grad_placement` is how its gradient relates to the full one over the same group:
    `Replicate()`, except for a sequence-parallel parameter whose gradient holds only my
    tokens' summand, `Partial()`, until the step's all-reduce sums it
    (minipar/parallel/tensor/sequence_grads.py); the optimizers refuse it until then.
    `grad_dtype` is the dtype its `.grad` accumulates in, None for its own (a bf16
    weight's fp32 main_grad: minipar.parallel.data.ddp.accumulate_gradients_in).
    """

    __slots__ = ("placement", "placement_group", "grad_category", "grad_placement",
                 "grad_dtype")

    def __init__(self, data, requires_grad: bool = True, placement=None, placement_group=None):
        super().__init__(data, requires_grad=requires_grad)
        self.placement = Replicate() if placement is None else placement
        self.placement_group = placement_group
        # The ledger category of the .grad that backward creates (ZeRO-2/3: "buffers").
        self.grad_category = "grads"
        self.grad_placement = Replicate()
        self.grad_dtype = None

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


class Module:
    """Base class of layers and models. Subclasses call `super().__init__()` first and
    define `forward`; `module(x)` calls `forward(x)`."""

    def __init__(self):
        object.__setattr__(self, "_parameter_names", [])
        object.__setattr__(self, "_module_names", [])
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_hooks", None)  # {method: ([pre-hooks], [hooks])}

    def __setattr__(self, name: str, value) -> None:
        try:
            parameter_names = self._parameter_names
            module_names = self._module_names
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__}: call super().__init__() before assigning attributes"
            ) from None
        if isinstance(value, Parameter):
            if name in module_names:
                module_names.remove(name)
            if name not in parameter_names:
                parameter_names.append(name)
        elif isinstance(value, Module):
            if name in parameter_names:
                parameter_names.remove(name)
            if name not in module_names:
                module_names.append(name)
        else:
            if name in parameter_names:
                parameter_names.remove(name)
            if name in module_names:
                module_names.remove(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        for names in (self._parameter_names, self._module_names):
            if name in names:
                names.remove(name)
        object.__delattr__(self, name)

    def __call__(self, *args, **kwargs):
        if self._hooks is None:
            return self.forward(*args, **kwargs)
        return _call_with_hooks(self, "forward", type(self).forward, args, kwargs)

    # ------------------------------------------------------------------ hooks
    def register_forward_pre_hook(self, hook: Callable, method: str = "forward"):
        """Run `hook(module, args)` before every call of `method` (forward, or a
        `@hook_point` method); a tuple it returns replaces the args. Returns a handle
        whose `remove()` unregisters it."""
        return self._register_hook(hook, method, 0)

    def register_forward_hook(self, hook: Callable, method: str = "forward"):
        """Run `hook(module, args, output)` after every call of `method`; a value it
        returns replaces the output. Returns a handle whose `remove()` unregisters it."""
        return self._register_hook(hook, method, 1)

    def _register_hook(self, hook: Callable, method: str, which: int):
        if method != "forward" and not getattr(getattr(type(self), method, None),
                                               "hook_point", False):
            raise ValueError(f"{type(self).__name__}.{method} is not a hook point: hooks "
                             "wrap forward, or a method the class declares @hook_point")
        if self._hooks is None:
            object.__setattr__(self, "_hooks", {})
        hooks = self._hooks.setdefault(method, ([], []))[which]
        hooks.append(hook)
        return _Handle(hooks, hook)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    # ------------------------------------------------------------------ traversal
    def named_children(self) -> Iterator[tuple[str, Module]]:
        for name in self._module_names:
            yield name, getattr(self, name)

    def children(self) -> Iterator[Module]:
        for _, module in self.named_children():
            yield module

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module and every submodule, depth first, with dotted names."""
        stack = [(prefix, self)]
        while stack:
            name, module = stack.pop()
            yield name, module
            children = [(f"{name}.{child_name}" if name else child_name, child)
                        for child_name, child in module.named_children()]
            stack.extend(reversed(children))

    def modules(self) -> Iterator[Module]:
        for _, module in self.named_modules():
            yield module

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) in registration order; a shared Parameter once."""
        seen = set()
        for module_name, module in self.named_modules(prefix):
            for name in module._parameter_names:
                parameter = getattr(module, name)
                if id(parameter) in seen:
                    continue
                seen.add(id(parameter))
                yield (f"{module_name}.{name}" if module_name else name), parameter

    def parameters(self) -> Iterator[Parameter]:
        """The parameters of `named_parameters()`, without building their names (this
        runs every step in `zero_grad`)."""
        seen = set()
        stack = [self]
        while stack:
            module = stack.pop()
            for name in module._parameter_names:
                parameter = getattr(module, name)
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    yield parameter
            stack.extend(getattr(module, name) for name in reversed(module._module_names))

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, np.ndarray]:
        """{name: copy of the parameter's array}."""
        return {name: p.data.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Copy arrays into the parameters (in place, cast to each parameter's dtype).

        With `strict`, the keys must match `named_parameters()` exactly. A shape mismatch
        is always an error. Returns (missing_keys, unexpected_keys).
        """
        own = dict(self.named_parameters())
        missing = [name for name in own if name not in state_dict]
        unexpected = [name for name in state_dict if name not in own]
        if strict and (missing or unexpected):
            raise KeyError(
                f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} "
                "(pass strict=False to load a subset)"
            )
        mismatched = [
            f"{name}: checkpoint {np.shape(array)} vs model {own[name].shape}"
            for name, array in state_dict.items()
            if name in own and np.shape(array) != own[name].shape
        ]
        if mismatched:
            raise ValueError("load_state_dict: shape mismatch for " + "; ".join(mismatched))
        for name, array in state_dict.items():
            if name in own:
                parameter = own[name]
                parameter.data[...] = np.asarray(array).astype(parameter.dtype, copy=False)
        return missing, unexpected

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's gradient (released from the device ledger) or, with
        `set_to_none=False`, fill it with zeros."""
        for p in self.parameters():
            if set_to_none:
                p.release_grad()
            elif p.grad is not None:
                p.grad[...] = 0

    def train(self, mode: bool = True) -> Module:
        for module in self.modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)


def hook_point(method: Callable) -> Callable:
    """Declare `method` a place forward hooks can wrap, as they wrap `forward`
    (`module.register_forward_pre_hook(hook, method="embed")`)."""

    @functools.wraps(method)
    def hooked(self, *args, **kwargs):
        if self._hooks is None:
            return method(self, *args, **kwargs)
        return _call_with_hooks(self, method.__name__, method, args, kwargs)

    hooked.hook_point = True
    return hooked


def _call_with_hooks(module: Module, name: str, method: Callable, args: tuple, kwargs: dict):
    pre, post = module._hooks.get(name, ((), ()))
    for hook in pre:
        changed = hook(module, args)
        if changed is not None:
            args = changed if isinstance(changed, tuple) else (changed,)
    output = method(module, *args, **kwargs)
    for hook in post:
        changed = hook(module, args, output)
        if changed is not None:
            output = changed
    return output


class _Handle:
    """What `register_forward_*hook` returns: `remove()` takes the hook out again."""

    def __init__(self, hooks: list, hook: Callable):
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


class ModuleList(Module):
    """A list of modules registered as "0", "1", ... (GPT-2's `h.0`, `h.1`, ...), or from
    `start` on (a pipeline stage's blocks keep their global index: "h.5", "h.6").
    Indexing and iteration are by position, as a list's."""

    def __init__(self, modules=(), start: int = 0):
        super().__init__()
        self._items: list[Module] = []
        self._start = start
        for module in modules:
            self.append(module)

    def append(self, module: Module) -> ModuleList:
        setattr(self, str(self._start + len(self._items)), module)
        self._items.append(module)
        return self

    def __getitem__(self, index: int) -> Module:
        return self._items[index]

    def __setitem__(self, index: int, module: Module) -> None:
        index = range(len(self._items))[index]
        setattr(self, str(self._start + index), module)
        self._items[index] = module

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._items)
