"""Exercise 07: split a Linear's backward into B and W, then schedule ZB-H1 for one rank.

Check your work:   python -m exercises.check 07

Zero-bubble pipeline parallelism (Qi, Wan, Huang, Lin, ICLR 2024, "Zero Bubble Pipeline
Parallelism", sections 2 and 3.1, figures 1-3) splits the backward of every layer in two:

    B  the gradient of the layer's *input*: the previous pipeline stage waits for it;
    W  the gradients of its *weights*: nobody waits for them, so W can run later, in the
       time the stage would otherwise sit idle (the pipeline bubble).

For a linear layer y = x @ W + b (x: (..., in), W stored (in, out) as in Hugging Face
GPT-2, y: (..., out)), with g = dL/dy of y's shape:
    B:  dL/dx = g @ W^T                               shape of x
    W:  dL/dW = x^T @ g, dL/db = sum of g over rows   with x, g flattened to 2D rows
B needs only g and W; W needs only x and g, which must therefore be kept until W runs.

ZB-H1 (figure 3, top; the ZB authors' "zb-h1" patch to Megatron-LM's 1F1B) keeps 1F1B's
order of forwards (F) and input gradients (I, PyTorch's name for B in its schedule IR)
and delays the W's. Stage r of p (0-indexed), m micro-batches:
    1. warm-up: min(p - r - 1, m) forwards, as 1F1B;
    2. then for i = 0 .. m-1: the next forward if any remain, then I(i); after I(i), if
       at least r + 1 W's are queued (i >= r), run the oldest queued W;
    3. at the end: the W's still queued, oldest first.
So stage r holds r more micro-batches' W inputs than 1F1B, but never more than p
micro-batches between F and W (1F1B's peak, stage 0's), and the W's of the later stages
fill the cool-down: the bubble drops from 1F1B's (p-1)(T_F+T_B+T_W) per stage to
(p-1)(T_F+T_B-T_W) (the paper's Table 2; T_B is I's time).

Example, p = 4, m = 8, stage 1: F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4
I6 W5 I7 W6 W7.

Use NumPy for the gradients; do not import the library's answers (minipar's Linear
backward, backward_input, zb_h1, make_schedule...): the checker refuses them.
"""

from __future__ import annotations

import numpy as np  # noqa: F401 - you will need it


def linear_backward_input(grad_out: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """B: dL/dx of y = x @ weight + bias. grad_out: (..., out); weight: (in, out).
    Returns an array of shape (..., in)."""
    raise NotImplementedError("linear_backward_input: your code here")


def linear_backward_weight(x: np.ndarray, grad_out: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
    """W: (dL/dweight (in, out), dL/dbias (out,)) of y = x @ weight + bias.
    x: (..., in) the layer's input saved by forward; grad_out: (..., out)."""
    raise NotImplementedError("linear_backward_weight: your code here")


def zb_h1_compute_order(pp: int, micro_batches: int, rank: int) -> list[tuple[str, int]]:
    """Stage `rank`'s ZB-H1 order: [("F", 0), ..., ("I", 0), ("W", 0), ...], one F, one I
    and one W for every micro-batch i in range(micro_batches), as the rules above say.

    What the checker measures, for (p, m) = (2, 2), (2, 4), (3, 3), (4, 4), (4, 8):
    - the order against the rules, stage by stage;
    - the lists of all p stages, with sends and receives added, run on paper without
      deadlock (minipar.parallel.pipeline.simulator.simulate_step) and every W after its I;
    - at most p micro-batches between F and W on every stage (1F1B's peak);
    - with T_F = T_B = T_W = 1, (p - 1)(T_F + T_B - T_W) = p - 1 units idle per stage.
    """
    raise NotImplementedError("zb_h1_compute_order: your code here")
