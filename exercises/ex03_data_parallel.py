"""Exercise 03: data parallelism with gradient accumulation and one all-reduce per step.

Check your work:   python -m exercises.check 03

Data parallelism (DP): every rank holds a whole replica of the model and trains on its own
slice of the global batch; before the optimizer step the ranks average their gradients,
so every replica takes the same step and the replicas stay equal. This is what PyTorch's
DistributedDataParallel does (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB; section 3 and its `no_sync`).

Gradient accumulation: a rank that cannot fit its whole slice in memory runs it as A
micro-batches, one after another, and lets backward *add* their gradients into p.grad.
The trick DDP's `no_sync` teaches: communicate only once, after the last micro-batch.
Reducing after every micro-batch would move the same bytes A times for the same result.

The global batch of one step has N * A * M sequences (N ranks, A micro-batches of M).
Single-device training would take one step on the mean loss over all of them. Your step
must give the same parameters (in fp64, up to rounding): the mean over the global batch is
the mean over the ranks of the mean over each rank's micro-batches of each micro-batch's
mean loss (all micro-batches have M sequences).

Read minipar/parallel/data/ddp.py's docstring for the big picture, but do not use it: the
checker refuses minipar.parallel and minipar.train (they are the answer key).
"""

from __future__ import annotations

import numpy as np  # noqa: F401 - you will need it

from minipar import distributed as dist  # noqa: F401 - dist.all_reduce(array, op=..., group=group)


def train_step(model, optimizer, micro_batches, group) -> float:
    """One optimizer step of data-parallel training, from this rank's point of view.

    model         this rank's replica: a `minipar.nn.GPT` (fp64); `loss = model(x, y)`
                  returns the mean cross-entropy of a micro-batch as a one-element Tensor;
                  `model.parameters()` yields its Parameters (`p.data`, `p.grad` ndarrays)
    optimizer     `minipar.nn.AdamW` over the model's parameters: `optimizer.step()` updates
                  every p.data from p.grad, `optimizer.zero_grad()` clears the gradients
    micro_batches this rank's A micro-batches, [(x, y), ...]; x, y int arrays (M, T)
    group         the data-parallel ProcessGroup of the N ranks
    Returns this rank's mean loss over its micro-batches, a float.

    Steps:
    1. For every micro-batch: forward, then backward of the loss scaled by 1/A
       (`loss.backward(np.asarray(1.0 / A))`): backward adds into p.grad, so after the last
       one p.grad holds the gradient of this rank's mean loss. No communication here.
    2. After the last backward: put every gradient into ONE flat buffer (a "bucket"),
       average it over the group with ONE `dist.all_reduce(..., op="avg", group=group)`,
       and copy the averages back into each p.grad.
    3. `optimizer.step()`, then `optimizer.zero_grad()` so the next step starts from zero.

    What the checker measures (N = 2, 3, 4 ranks, A = 3, 2, 1 micro-batches, 2 steps):
    - the gradients your optimizer step sees equal single-device gradients of the global
      batch, and the parameters after each step equal single-device training (fp64);
    - no communication between micro-batches; exactly one all-reduce per step, of all the
      gradients: 2(N-1)/N * 8 bytes per parameter element sent by each rank;
    - every replica ends the step with the same parameters; p.grad is zero or None after.

    Hints: `np.concatenate([p.grad.reshape(-1) for p in params])` flattens; remember each
    parameter's offset and size to copy the averages back (`p.grad[...] = ...`). Why "avg"
    and not "sum"? Each rank's loss is already a mean over its own sequences.
    """
    raise NotImplementedError("train_step: your code here")
