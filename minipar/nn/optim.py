"""AdamW, gradient clipping and the learning-rate schedule.

AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization") is Adam
(Kingma & Ba 2015) whose weight decay shrinks the weights directly instead of being added
to the gradient. The arithmetic is `adamw_update`, a pure in-place function on ndarrays,
so ZeRO can run it on flat shards of parameters, gradients and moments.

Conventions:
- Weight decay applies to parameters with ndim >= 2 (matmul weights, embeddings), not to
  biases and LayerNorm parameters (nanoGPT's `configure_optimizers`).
- Mixed precision: for bf16 parameters the optimizer keeps an fp32 master copy, updates
  it and rounds it back into the bf16 parameter; m and v are fp32 (ZeRO's 12 bytes per
  parameter). fp32/fp64 parameters are updated in place, m and v in their dtype.
- FLOPs: `ADAMW_FLOPS_PER_ELEMENT` per parameter element and step, reported as
  "optimizer" work.
"""

from __future__ import annotations

import math

import numpy as np

from minipar.autograd.kernels import Kernel
from minipar.autograd.precision import bfloat16, float32
from minipar.autograd.tracking import charge, current_device

ADAMW_FLOPS_PER_ELEMENT = 14


def adamw_bytes(param: np.ndarray, grad: np.ndarray, states) -> int:
    """HBM bytes of one AdamW update: reads and writes the parameter and each state array
    (fp32 master weights, the two moments), reads the gradient."""
    state = sum(a.nbytes for a in states if a is not None)
    return 2 * (param.nbytes + state) + grad.nbytes


def report_optimizer(device, elements: int, nbytes: int) -> None:
    """Book an optimizer step of `elements` parameters on the device (one streaming
    kernel for a device that prices kernels: minipar.distributed.roofline)."""
    flops = ADAMW_FLOPS_PER_ELEMENT * elements
    if getattr(device, "wants_kernels", False):
        charge(device, flops, "optimizer", "AdamW", (Kernel(flops, nbytes),))
    else:
        charge(device, flops, "optimizer", "AdamW")


def adamw_update(param: np.ndarray, grad: np.ndarray, exp_avg: np.ndarray,
                 exp_avg_sq: np.ndarray, step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay) -> None:
    """One AdamW step, in place on `param` (the master weights), `exp_avg` (m) and
    `exp_avg_sq` (v); same formula as torch.optim.AdamW:

        param *= 1 - lr * weight_decay
        m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
        param -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

    `step` counts from 1. `weight_decay` is a float or an array broadcastable to `param`
    (a flat ZeRO shard mixes decayed and undecayed parameters).
    """
    if grad.dtype != param.dtype:
        grad = grad.astype(param.dtype)
    if isinstance(weight_decay, np.ndarray):
        param *= (1.0 - lr * weight_decay).astype(param.dtype, copy=False)
    elif weight_decay:
        param *= 1.0 - lr * weight_decay
    exp_avg *= beta1
    exp_avg += (1.0 - beta1) * grad
    exp_avg_sq *= beta2
    scratch = grad * grad
    scratch *= 1.0 - beta2
    exp_avg_sq += scratch
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    denom = np.sqrt(exp_avg_sq, out=scratch)
    denom *= 1.0 / math.sqrt(bias_correction2)
    denom += eps
    update = np.divide(exp_avg, denom, out=denom)
    update *= lr / bias_correction1
    param -= update


class AdamW:
    """AdamW over `params`: Parameters, or (name, Parameter) pairs such as
    `model.named_parameters()` (names label the state dict; default "0", "1", ...).

    Set `optimizer.lr` before `step()` to follow a schedule. Parameters whose `.grad` is
    None are skipped by a step. The state (m, v and the master copy, if any) is allocated
    at construction and held in the device ledger as "optimizer".
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1):
        if lr < 0:
            raise ValueError(f"AdamW: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {betas}")
        if eps <= 0:
            raise ValueError(f"AdamW: eps must be > 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"AdamW: weight_decay must be >= 0, got {weight_decay}")
        items = list(params)
        if not items:
            raise ValueError("AdamW: got an empty parameter list")
        if isinstance(items[0], tuple):
            self.names = [name for name, _ in items]
            self.params = [p for _, p in items]
        else:
            self.names = [str(i) for i in range(len(items))]
            self.params = items
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        self.master, self.exp_avg, self.exp_avg_sq = [], [], []
        device = current_device()
        for p in self.params:
            if p.dtype == bfloat16:
                state_dtype = float32
                master = p.data.astype(float32)
            else:
                state_dtype = p.dtype
                master = None
            self.master.append(master)
            self.exp_avg.append(np.zeros(p.shape, dtype=state_dtype))
            self.exp_avg_sq.append(np.zeros(p.shape, dtype=state_dtype))
        if device is not None:
            for array in self._state_arrays():
                device.memory.hold(array, "optimizer")

    def _state_arrays(self):
        for master, m, v in zip(self.master, self.exp_avg, self.exp_avg_sq, strict=True):
            if master is not None:
                yield master
            yield m
            yield v

    def step(self) -> None:
        self.step_count += 1
        beta1, beta2 = self.betas
        elements = nbytes = 0
        states = zip(self.params, self.master, self.exp_avg, self.exp_avg_sq, strict=True)
        for p, master, m, v in states:
            if p.grad is None:
                continue
            weight = p.data if master is None else master
            decay = self.weight_decay if p.ndim >= 2 else 0.0
            adamw_update(weight, p.grad, m, v, self.step_count, self.lr, beta1, beta2,
                         self.eps, decay)
            if master is not None:
                p.data[...] = master.astype(p.dtype)  # round the master back into bf16
            elements += p.size
            nbytes += adamw_bytes(p.data, p.grad, (master, m, v))
        device = current_device()
        if device is not None and elements:
            report_optimizer(device, elements, nbytes)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.release_grad()
            elif p.grad is not None:
                p.grad[...] = 0

    def state_dict(self) -> dict[str, np.ndarray]:
        """Flat {key: ndarray}: "step", "exp_avg.<name>", "exp_avg_sq.<name>" and, for
        mixed precision, "master.<name>" - loadable by np.savez/np.load, no pickle."""
        state = {"step": np.asarray(self.step_count, dtype=np.int64)}
        for name, master, m, v in zip(self.names, self.master, self.exp_avg,
                                      self.exp_avg_sq, strict=True):
            state[f"exp_avg.{name}"] = m.copy()
            state[f"exp_avg_sq.{name}"] = v.copy()
            if master is not None:
                state[f"master.{name}"] = master.copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()` (arrays copied in place, so the ledger is unchanged)."""
        expected = set(self.state_dict())
        if set(state) != expected:
            raise KeyError(
                f"AdamW.load_state_dict: missing keys {sorted(expected - set(state))}, "
                f"unexpected keys {sorted(set(state) - expected)}"
            )
        self.step_count = int(state["step"])
        for name, master, m, v in zip(self.names, self.master, self.exp_avg,
                                      self.exp_avg_sq, strict=True):
            targets = [(m, "exp_avg"), (v, "exp_avg_sq")]
            if master is not None:
                targets.append((master, "master"))
            for array, kind in targets:
                value = np.asarray(state[f"{kind}.{name}"])
                if value.shape != array.shape:
                    raise ValueError(f"AdamW.load_state_dict: {kind}.{name} has shape "
                                     f"{value.shape}, expected {array.shape}")
                array[...] = value


def grad_norm_squared(arrays) -> float:
    """Sum of squares of all arrays, accumulated in fp64 in the given order.

    Sharded runs compute this on their shards and all-reduce the partial sums before the
    square root, so it is factored out of `clip_grad_norm_`.
    """
    total = 0.0
    for a in arrays:
        a64 = a.astype(np.float64, copy=False)
        total += float(np.sum(a64 * a64))
    return total


def clip_grad_norm_(params, max_norm: float) -> float:
    """Scale all gradients in place so their global L2 norm is at most `max_norm`
    (as torch.nn.utils.clip_grad_norm_, coefficient max_norm / (norm + 1e-6)).
    Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    total_norm = math.sqrt(grad_norm_squared(grads))
    scale_grads_(grads, max_norm / (total_norm + 1e-6))
    return total_norm


def scale_grads_(grads, coefficient: float) -> None:
    """Multiply gradients in place by `coefficient` when it is below 1 (clipping)."""
    if coefficient >= 1.0:
        return
    for g in grads:
        if g.dtype == bfloat16:
            g[...] = (g.astype(float32) * coefficient).astype(bfloat16)
        else:
            g *= coefficient


def lr_schedule(step: int, *, lr: float, warmup_steps: int, total_steps: int,
                min_lr: float) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then cosine decay to `min_lr` at
    `total_steps` (Loshchilov & Hutter 2017, SGDR; nanoGPT's get_lr). `step` from 0."""
    if warmup_steps < 0 or total_steps <= 0 or warmup_steps > total_steps:
        raise ValueError(f"lr_schedule: need 0 <= warmup_steps <= total_steps and "
                         f"total_steps > 0, got warmup_steps={warmup_steps}, "
                         f"total_steps={total_steps}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
