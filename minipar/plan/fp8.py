"""FP8 training as Transformer Engine runs it under Megatron-LM (`--fp8-format`): the
kernels of one FP8 linear layer, for the planner's roofline.

Micikevicius et al. 2022 ("FP8 Formats for Deep Learning") train with the GEMMs of the
linear layers in 8-bit floats: E4M3 for weights and activations, E5M2 (more range, less
precision) for gradients ("hybrid"), each tensor with a per-tensor scale. Transformer
Engine (TE) does it with delayed scaling (Megatron-Core's default `fp8_recipe`): a scale
from the amax history of earlier iterations, so casting is one streaming pass. Only the
layers' four linear layers change (TE's LayerNormLinear for QKV and the MLP's fc1, its
Linear for the attention projection and fc2: megatron/core/models/gpt/
gpt_layer_specs.py); everything else stays bf16: the norms' arithmetic, Megatron's own
activation between fc1 and fc2, the attention core, the embedding and the output layer
(not TE modules), the residual stream, the optimizer with its fp32 master weights.

A layer's twelve GEMMs (forward, input gradient, weight gradient of the four) run on
Hopper's FP8 tensor cores, twice the bf16 peak, and TE adds the casts that feed them
(TE 2.x, transformer_engine/pytorch/module/{linear,layernorm_linear,base}.py). For a
forward GEMM y (m, n) = x (m, k) @ W (k, n), in bytes moved per element:

    forward   LayerNormLinear: the norm writes its output in FP8 (1 byte, not 2);
              Linear: x cast to FP8 and to its FP8 transpose       read 2, write 1 + 1
              y = x W in FP8, output bf16                          m k + k n + 2 m n
    backward  dy cast to FP8 and its FP8 transpose                 read 2, write 1 + 1
              (a row-parallel layer under sequence parallelism casts its shard of dy,
              all-gathers it in FP8, then transposes the whole: 3 a shard, 2 the whole)
              LayerNormLinear: the FP8 norm output transposed      read 1, write 1
              dx = dy W^T in FP8 (W's cached FP8 transpose)        m n + n k + 2 m k
              dW = x^T dy in FP8                                   m k + m n + 2 k n

and each weight cast to FP8 and its transpose (read 2, write 1 + 1) once per optimizer
step: TE caches them over a step's micro-batches when told which is the first
(`is_first_microbatch`, which Megatron-Core passes: megatron/core/extensions/
transformer_engine.py, pipeline_parallel/schedules.py). With `--fp8-param-gather` the
weights are FP8 parameters instead: the optimizer casts its fp32 shard to FP8 (read 4,
write 1) and each gathered weight is transposed (read 1, write 1; megatron/core/
fp8_utils.py). Under sequence parallelism the all-gathers of the layers' FP8 inputs and
gradients move 1 byte an element, the reduce-scatters stay bf16 (plan/traffic.py).

Memory (plan/memory.py): TE keeps each layer's FP8 weights and their transposes between
steps (+2 bytes a GEMM parameter, `_fp8_workspaces`; with `--fp8-param-gather` the FP8
parameter and its transpose replace the bf16 one, +0), and saves FP8 inputs for backward
where bf16 ones were: the two norms' outputs and fc2's input shrink to 1 byte an element,
and the projection keeps a 1-byte FP8 copy of its input beside the bf16 one the attention
saves (TE refuses `save_original_input` under delayed scaling).

What minipar does not price: the amax reductions (two latency-bound all-reduces of a
few dozen bytes a layer per micro-batch), the 1-byte parameter all-gather of
`--fp8-param-gather` (priced in bf16: the recipes that set it overlap it), FP8
reduce-scatters (TE's userbuffers `fp8_buf`, which some NeMo recipes set for the
projection's and fc2's), FP8 attention. An MoE model is refused (`check_fp8_plan`):
Megatron-LM runs its experts in FP8 too. The FP8 GEMMs' efficiency is fitted
(roofline.py, benchmarks/fit_time_model.py) on NeMo's runs, which keep FP8 parameters,
a 1,024-step amax history and TE's userbuffers overlap.
"""

from __future__ import annotations

import functools

from minipar.autograd.kernels import Kernel
from minipar.errors import ConfigError

FP8 = 1  # bytes per element of an FP8 tensor
# what fits the FP8 GEMM efficiency (roofline.H100_FP8_GEMM_EFFICIENCY)
FP8_CALIBRATION = ("NVIDIA's 32 FP8 DGX Cloud Benchmarking runs of NeMo (release "
                   "v24.11.1; FP8 parameters, TE's userbuffers overlap), held out on 56 "
                   "runs of four later releases (minipar plan --compare-published --source "
                   "dgxc-fp8 --source dgxc-25-fp8)")


def fp8_gemm_kernel(m: int, n: int, k: int, out_itemsize: int) -> Kernel:
    """C (m, n) = A (m, k) @ B (k, n) on the FP8 tensor cores: 2mnk FLOPs, FP8 operands
    read once, C written in the activations' dtype."""
    return Kernel(flops=2.0 * m * n * k,
                  nbytes=float(FP8 * (m * k + k * n) + out_itemsize * m * n),
                  gemm=(1, m, n, k), fp8=True)


def cast_transpose(elements: int, itemsize: int) -> Kernel:
    """A bf16 tensor read once, written as FP8 and as its FP8 transpose."""
    return Kernel(0.0, float((itemsize + 2 * FP8) * elements))


def cast(elements: int, itemsize: int) -> Kernel:
    """A bf16 tensor read once, written as FP8."""
    return Kernel(0.0, float((itemsize + FP8) * elements))


def transpose(elements: int) -> Kernel:
    """An FP8 tensor's FP8 transpose (for a weight gradient)."""
    return Kernel(0.0, float(2 * FP8 * elements))


@functools.lru_cache(maxsize=1024)
def fp8_linear_kernels(m: int, n: int, k: int, itemsize: int, bias: bool,
                       input_in_fp8: bool = False, grad_gathered: int = 1
                       ) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """(forward, backward) kernels of a TE linear layer (m, k) @ (k, n) in FP8 (module
    docstring). input_in_fp8: the LayerNorm before it wrote its input in FP8
    (LayerNormLinear), so forward has no cast and backward transposes the saved FP8
    input; otherwise forward casts and transposes x. grad_gathered: dy arrives as 1/g of
    its rows and is all-gathered in FP8 (a row-parallel layer under sequence parallelism
    over g ranks): cast the shard, transpose the whole; 1: cast and transpose dy. A bias
    is added in the GEMM's epilogue and its gradient summed in the cast of dy (counted,
    not priced apart)."""
    gemm = fp8_gemm_kernel(m, n, k, itemsize)
    if bias:
        gemm = Kernel(gemm.flops + m * n, gemm.nbytes, gemm.gemm, fp8=True)
    forward = (gemm,) if input_in_fp8 else (cast_transpose(m * k, itemsize), gemm)
    if grad_gathered > 1:
        backward = [cast(m * n // grad_gathered, itemsize), transpose(m * n)]
    else:
        backward = [cast_transpose(m * n, itemsize)]
    if bias:  # the bias gradient: dy's column sums, in the kernel that casts dy
        backward.append(Kernel(m * n, 0.0))
    if input_in_fp8:
        backward.append(transpose(m * k))
    backward += [fp8_gemm_kernel(m, k, n, itemsize), fp8_gemm_kernel(k, n, m, itemsize)]
    return forward, tuple(backward)


def weight_cast_kernels(weights: int, itemsize: int, fp8_params_of: int = 0
                        ) -> tuple[Kernel, ...]:
    """Once per optimizer step: the layers' `weights` bf16 weights cast to FP8 and FP8
    transposes (the first micro-batch's forward); with FP8 parameters
    (`--fp8-param-gather`) sharded over `fp8_params_of` data-parallel ranks, the
    optimizer's cast of its fp32 shard (read 4, write 1) and each gathered weight's
    transpose instead."""
    if fp8_params_of:
        return (Kernel(0.0, float(5 * weights / fp8_params_of)), transpose(weights))
    return (cast_transpose(weights, itemsize),)


def check_fp8_plan(shape, fp8_format: str | None, cluster) -> None:
    """A clear error for FP8 where the planner cannot price it: a GPU without FP8 tensor
    cores (the A100), the uniform model (one sustained rate, no GEMMs: --efficiency), or
    an MoE model (Megatron-LM runs its experts in FP8 too, TEGroupedMLP in
    megatron/core/transformer/moe/experts.py, which this model of a layer does not
    price)."""
    if fp8_format is None:
        return
    if shape.is_moe:
        raise ConfigError("fp8_format", "an MoE model's experts run in FP8 too in "
                          "Megatron-LM (TEGroupedMLP), which the planner does not price: "
                          "plan it in bf16 (drop --fp8-format)")
    roofline = cluster.roofline
    if roofline is None:
        raise ConfigError("fp8_format", "FP8 is priced per GEMM on the GPU's roofline; the "
                          "uniform model (--efficiency) has one rate for every FLOP: drop "
                          "--efficiency, or --fp8-format")
    if not roofline.has_fp8:
        raise ConfigError("fp8_format", f"{roofline.name} has no FP8 tensor cores "
                          "(Hopper and later do): plan bf16, or an H100 cluster")


def gemm_weights(shape, tp: int) -> int:
    """The weights of one layer's four FP8 GEMMs on one TP rank (its biases stay bf16)."""
    h = shape.d_model
    return (h * shape.qkv_width + h * h + h * shape.mlp_in_width + shape.ffn * h) // tp


def weight_cache_bytes(weights: int) -> int:
    """What TE keeps of `weights` GEMM weights between steps: each one's FP8 copy and
    FP8 transpose."""
    return 2 * FP8 * weights


def saved_activation_savings(shape, b: int, tp: int, sequence_parallel: bool,
                             itemsize: int) -> int:
    """Bytes one dense layer saves for backward less under FP8 than in `itemsize`, on one
    TP rank for b sequences (shape: one CP rank's tokens): the norms' outputs (the QKV
    and fc1 inputs, on the replicated stream) and fc2's input at 1 byte, less the
    projection's FP8 copy of its input. -(h + f) T / t with sequence parallelism."""
    h, tokens = shape.d_model, b * shape.seq_len
    stream = tokens // tp if sequence_parallel else tokens
    return ((itemsize - FP8) * (2 * stream * h + tokens * shape.ffn // tp)
            - FP8 * tokens * h // tp)
