"""Neural-network modules on minipar.autograd, shaped like `torch.nn`: `Module`,
layers, the GPT-2 model and the AdamW optimiser."""

from minipar.nn.gpt import (
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    GPTConfig,
    LMHead,
    init_parameter,
    initialize_parameters,
    parameter_shapes,
)
from minipar.nn.layers import Dropout, Embedding, LayerNorm, Linear
from minipar.nn.module import Module, ModuleList, Parameter
from minipar.nn.optim import (
    AdamW,
    adamw_update,
    clip_grad_norm_,
    grad_norm_squared,
    lr_schedule,
)
from minipar.nn.recompute import Recompute

__all__ = [
    "GPT",
    "MLP",
    "AdamW",
    "Block",
    "CausalSelfAttention",
    "Dropout",
    "Embedding",
    "GPTConfig",
    "LMHead",
    "LayerNorm",
    "Linear",
    "Module",
    "ModuleList",
    "Parameter",
    "Recompute",
    "adamw_update",
    "clip_grad_norm_",
    "grad_norm_squared",
    "init_parameter",
    "initialize_parameters",
    "lr_schedule",
    "parameter_shapes",
]
