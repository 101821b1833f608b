"""GPT-2 (Radford et al. 2019) at toy scale, with Hugging Face's names and layouts.

    x = wte[idx] + wpe[:T]                          embed(idx)        (B, T, d)
    for block in h:                                 h[i](x)
        x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))    (pre-LayerNorm)
    loss = CE(ln_f(x) @ wte.T, targets)             head(x, targets)

`embed`, the blocks and `head` are separate so a pipeline stage, a GPT over some of
the layers, runs its share.
Attention reads its number of heads off the width of its `c_attn` output, so a
column-parallel `c_attn` that holds a subset of heads works unchanged.

Llama's shape choices (Touvron et al. 2023) are settings of the same model: grouped-query
attention (n_kv_head), the MLP's width (d_ff) and SwiGLU (mlp="swiglu"), an untied head
(tie_embeddings=False); minipar keeps GPT-2's LayerNorm, biases and learned positions.
This module is long because it is the whole model a student reads in one place: its
config, initialisation, attention, MLP, block, head and the stage-able GPT.

Initialisation is a pure function of (parameter name, seed): `init_parameter` draws each
parameter from its own generator seeded with (seed, crc32(name)). The same seed gives
the same full weights whatever is built, in whatever order: a pipeline stage that builds
only some blocks, or a tensor-parallel rank that slices a weight, agrees with the
single-device model.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from minipar.autograd import functional as F
from minipar.autograd.checkpoint import checkpoint
from minipar.autograd.grad_mode import is_grad_enabled
from minipar.autograd.precision import get_policy
from minipar.autograd.tensor import Tensor
from minipar.nn.layers import (
    INITIAL_DRAWS,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    Identity,
    LayerNorm,
    Linear,
)
from minipar.nn.module import Module, ModuleList, Parameter, hook_point
from minipar.nn.moe import MoE, attach_aux_loss
from minipar.nn.recompute import Recompute, run_blocks

MLP_KINDS = ("gelu", "swiglu")


class TransformerSizes:
    """The widths a transformer's settings imply (d_model, n_head, n_kv_head, d_ff, mlp),
    for this module's GPTConfig and the planner's ModelShape alike: one definition."""

    __slots__ = ()

    def check_widths(self) -> None:
        """Refuse a width that is not a positive integer, heads that do not tile d_model,
        or query heads that the key/value heads do not group evenly."""
        owner = type(self).__name__
        for name in ("n_kv_head", "d_ff"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer))
                                      or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{owner}.{name} must be a positive integer (or None), "
                                 f"got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"{owner}: d_model={self.d_model} is not divisible by "
                             f"n_head={self.n_head}; pick n_head dividing d_model")
        if self.n_head % self.kv_heads:
            raise ValueError(f"{owner}: n_head={self.n_head} is not a multiple of "
                             f"n_kv_head={self.kv_heads}: each key/value head serves a group "
                             "of query heads")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head (multi-head attention)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def grouped_query(self) -> bool:
        return self.kv_heads != self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): n_kv_head x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        """c_attn's output width: Q (d_model), then K and V (kv_dim each)."""
        return self.d_model + 2 * self.kv_dim

    @property
    def ffn(self) -> int:
        """The MLP's hidden width f: d_ff, or GPT-2's 4 d_model."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @property
    def mlp_in_width(self) -> int:
        """c_fc's output width: f, or SwiGLU's gate and up projections fused, 2f."""
        return (2 if self.mlp == "swiglu" else 1) * self.ffn


@dataclass(frozen=True)
class GPTConfig(TransformerSizes):
    """Model shape. `seq_len` is the context length (rows of wpe)."""

    vocab_size: int = 65
    seq_len: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = True
    # Llama's shape (Touvron et al. 2023): grouped-query attention with n_kv_head key/value
    # heads (None: n_head, multi-head attention), an MLP of width d_ff (None: 4 d_model),
    # GELU (GPT-2) or SwiGLU (three matrices: gate, up, down)
    n_kv_head: int | None = None
    d_ff: int | None = None
    mlp: str = "gelu"
    # Mixture of experts (minipar/nn/moe.py; Megatron's --num-experts, --moe-router-topk,
    # --moe-expert-capacity-factor, --moe-aux-loss-coeff, --moe-layer-freq): 0 experts is
    # the dense GPT-2; otherwise block i's MLP is an MoE when i % moe_layer_freq == 0.
    moe_num_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float = 1.0
    moe_aux_loss_coeff: float = 0.01
    moe_layer_freq: int = 1

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) \
                    or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        self.check_widths()
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"GPTConfig.mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        if self.moe_num_experts:
            check_moe_settings(self)

    def is_moe_layer(self, i: int) -> bool:
        """Block i's MLP is a mixture of experts (Megatron's moe_layer_freq pattern)."""
        return self.moe_num_experts > 0 and i % self.moe_layer_freq == 0


def check_moe_settings(config: GPTConfig) -> None:
    """The MoE settings, each with its flag's name in the message."""
    e, k = config.moe_num_experts, config.moe_top_k
    for name, value in (("moe_num_experts", e), ("moe_top_k", k),
                        ("moe_layer_freq", config.moe_layer_freq)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
    if k > e:
        raise ValueError(f"GPTConfig: moe_top_k={k} exceeds moe_num_experts={e}: a token "
                         "picks k distinct experts")
    if not config.moe_capacity_factor > 0:
        raise ValueError("GPTConfig.moe_capacity_factor must be > 0, got "
                         f"{config.moe_capacity_factor!r}")
    if not config.moe_aux_loss_coeff >= 0:
        raise ValueError("GPTConfig.moe_aux_loss_coeff must be >= 0, got "
                         f"{config.moe_aux_loss_coeff!r}")
    if config.mlp != "gelu" or config.d_ff is not None:
        raise ValueError("GPTConfig: minipar's experts are GPT-2 MLPs (GELU, 4 d_model): "
                         "mlp='swiglu' or d_ff with moe_num_experts is not implemented")


def parameter_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's HF GPT-2 name and full shape, in `named_parameters()` order
    (grouped-query attention: c_attn of width d + 2 n_kv_head hd; SwiGLU: c_fc of 2f)."""
    d, v, f = config.d_model, config.vocab_size, config.ffn
    qkv = config.qkv_width
    shapes = {"wte.weight": (v, d), "wpe.weight": (config.seq_len, d)}
    for i in range(config.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (d, qkv), p + "attn.c_attn.bias": (qkv,),
            p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
        })
        mlps = [p + "mlp."]
        if config.is_moe_layer(i):
            shapes[p + "mlp.router.weight"] = (d, config.moe_num_experts)
            mlps = [f"{p}mlp.experts.{e}." for e in range(config.moe_num_experts)]
        for m in mlps:
            shapes.update({
                m + "c_fc.weight": (d, config.mlp_in_width),
                m + "c_fc.bias": (config.mlp_in_width,),
                m + "c_proj.weight": (f, d), m + "c_proj.bias": (d,),
            })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def init_parameter(name: str, shape: tuple[int, ...], config: GPTConfig,
                   seed: int) -> np.ndarray:
    """The initial value (fp64) of the full parameter `name`, GPT-2's scheme.

    LayerNorm weight 1, bias 0; other biases 0; weights and embeddings normal(0, 0.02);
    residual projections (`c_proj.weight`) normal(0, 0.02 / sqrt(2 n_layer)), the GPT-2
    paper's scaling for the 2 residual additions per layer.
    """
    module, _, kind = name.rpartition(".")
    module = module.rpartition(".")[2]
    if module.startswith("ln_"):
        return np.ones(shape) if kind == "weight" else np.zeros(shape)
    if kind == "bias":
        return np.zeros(shape)
    std = 0.02
    if module == "c_proj":
        std /= math.sqrt(2 * config.n_layer)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.normal(0.0, std, size=shape)


def initialize_parameters(module: Module, config: GPTConfig, seed: int,
                          prefix: str = "") -> None:
    """Set every parameter of `module` to `init_parameter(prefix + name)` (cast to its
    dtype). `prefix` places a part in the full model, e.g. "h.3." for block 3. The draws
    are shared by every rank and model that builds the same parameter (INITIAL_DRAWS in
    minipar/nn/layers.py): the same values, drawn once."""
    for name, p in module.named_parameters():
        full = prefix + name
        # init_parameter reads only n_layer off the config (the c_proj scaling)
        value = INITIAL_DRAWS.get(("gpt", full, tuple(p.shape), config.n_layer, seed),
                                  lambda f=full, s=p.shape: init_parameter(f, s, config, seed))
        p.data[...] = value  # cast as it is copied in (the same rounding as astype)


class CausalSelfAttention(Module):
    """Multi-head causal self-attention: c_attn (d, 3d) -> fused attention -> c_proj.

    With n_kv_head < n_head, grouped-query attention (Ainslie et al. 2023; Llama-2 70B,
    Mistral): c_attn (d, d + 2 n_kv_head hd) in Megatron-LM's layout, per key/value
    head its group's query heads then its k and v (F.grouped_query_attention), so that
    tensor parallelism hands each rank whole groups.

    checkpoint_core_attention: keep only qkv for backward and recompute softmax(QK^T)V
    there (selective recomputation, Korthikanti et al. 2022 section 5; Megatron-LM's
    `checkpoint_core_attention` in megatron/core/transformer/attention.py).
    """

    def __init__(self, config: GPTConfig, *, dtype=np.float64, generator=None,
                 checkpoint_core_attention: bool = False):
        super().__init__()
        d = config.d_model
        self.head_dim = config.head_dim
        self.group = config.n_head // config.kv_heads  # query heads per key/value head
        self.dropout_p = config.dropout
        self.generator = generator
        self.checkpoint_core_attention = checkpoint_core_attention
        self.c_attn = Linear(d, d + 2 * config.kv_heads * config.head_dim, dtype=dtype)
        self.c_proj = Linear(d, d, dtype=dtype)
        self.resid_dropout = Dropout(config.dropout, generator)

    def core_attention(self, qkv):
        """softmax(causal(QK^T / sqrt(head_dim))) V of my heads: (B, T, 3hd) -> (B, T, hd)
        (grouped-query: (B, T, KV (group + 2) hd) -> (B, T, KV group hd))."""
        p = self.dropout_p if self.training else 0.0
        if self.group > 1:
            return F.grouped_query_attention(qkv, self.head_dim, self.group, p,
                                             self.generator)
        return F.causal_self_attention(qkv, self.head_dim, p, self.generator)

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3 * local_heads * head_dim)
        if self.checkpoint_core_attention and self.training and is_grad_enabled():
            generator = self.generator if self.dropout_p > 0 else None
            y = checkpoint(self.core_attention, qkv, generator=generator)
        else:
            y = self.core_attention(qkv)
        return self.resid_dropout(self.c_proj(y))


class MLP(Module):
    """c_fc (d, f) -> GELU (tanh) -> c_proj (f, d), f = 4d for GPT-2; or Llama's SwiGLU
    (Shazeer 2020): c_fc (d, 2f) gives the gate and up projections fused (Megatron-LM's
    linear_fc1 with --swiglu), silu(gate) * up, c_proj (f, d)."""

    def __init__(self, config: GPTConfig, *, dtype=np.float64, generator=None):
        super().__init__()
        d = config.d_model
        self.gated = config.mlp == "swiglu"
        self.c_fc = Linear(d, config.mlp_in_width, dtype=dtype)
        self.c_proj = Linear(config.ffn, d, dtype=dtype)
        self.dropout = Dropout(config.dropout, generator)

    def forward(self, x):
        h = self.c_fc(x)
        return self.dropout(self.c_proj(F.swiglu(h) if self.gated else F.gelu(h)))


class Block(Module):
    """A pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).
    moe: the MLP is a mixture of experts (minipar/nn/moe.py)."""

    def __init__(self, config: GPTConfig, *, dtype=np.float64, generator=None,
                 checkpoint_core_attention: bool = False, moe: bool = False):
        super().__init__()
        d = config.d_model
        self.ln_1 = LayerNorm(d, dtype=dtype)
        self.attn = CausalSelfAttention(config, dtype=dtype, generator=generator,
                                        checkpoint_core_attention=checkpoint_core_attention)
        self.ln_2 = LayerNorm(d, dtype=dtype)
        if moe:
            self.mlp = MoE(d, config.moe_num_experts, config.moe_top_k,
                           config.moe_capacity_factor, config.moe_aux_loss_coeff, dtype=dtype)
        else:
            self.mlp = MLP(config, dtype=dtype, generator=generator)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        y = self.mlp(self.ln_2(x))
        if isinstance(self.mlp, MoE):  # the aux loss's gradient rides on y (moe.py)
            y = attach_aux_loss(y, self.mlp)
        return x + y


class LMHead(Module):
    """The output projection, logits = x @ W.T with W (vocab, d_model): its own weight
    (HF's `lm_head.weight`) when untied, else the weight passed in, wte for GPT-2's tied
    head (Megatron-LM's `output_layer(x, weight=shared_embedding_or_output_weight())`).
    gather_output: a vocabulary-parallel head all-gathers its logits; here they are whole."""

    def __init__(self, vocab_size: int, d_model: int, *, tied: bool = False,
                 dtype=np.float64):
        super().__init__()
        if not tied:
            self.weight = Parameter(np.zeros((vocab_size, d_model), dtype=dtype))

    def forward(self, x, weight=None, gather_output: bool = False):
        weight = self.weight if weight is None else weight
        return F.linear(x, weight, None, transpose_weight=True)


class PositionIds(Module):
    """The rows of wpe that a sequence of `length` tokens takes: 0 .. length-1 (Megatron's
    position_ids). Context parallelism swaps in its own: my tokens' global positions."""

    def __init__(self, seq_len: int):
        super().__init__()
        self.seq_len = seq_len

    def forward(self, length: int):
        if length > self.seq_len:
            raise ValueError(f"GPT: sequence length {length} exceeds seq_len {self.seq_len} "
                             "of the config")
        return slice(0, length)  # a view of wpe's first rows


def check_token_ids(idx) -> np.ndarray:
    """idx as an integer ndarray (B, T), or a ValueError."""
    idx = np.asarray(idx.data if isinstance(idx, Tensor) else idx)
    if idx.ndim != 2 or idx.dtype.kind not in "iu":
        raise ValueError(f"GPT: idx must be an integer array (B, T), got shape "
                         f"{idx.shape} dtype {idx.dtype}")
    return idx


class GPT(Module):
    """The model: `loss = model(idx, targets)`, or logits (B, T, V) without targets.

    precision: "fp64", "fp32" or "bf16-mixed" (parameter and activation dtype; see
    minipar.autograd.precision). recompute: which activations backward recomputes
    (selective, or full for some blocks; minipar.nn.recompute); None keeps them all.

    A pipeline stage is a GPT over some of the layers (Megatron-LM's GPTModel with
    pre_process / post_process): `layers`, a range of global indices (default all), the
    embedding if `pre_process`, ln_f, the LM head and the loss if `post_process`. Blocks
    are registered under their global index, so a stage's parameter names are the whole
    model's ("h.5.attn.c_attn.weight" wherever layer 5 is); a last stage without the
    first holds its own copy of a tied wte (the pipeline keeps the copies equal). `stage`
    (a virtual stage's index) gives the stage its own dropout stream, as Megatron seeds
    each pipeline rank apart. Parameters are initialised by global name, so a stage
    starts equal to the same layers of the whole model.

    Parallel strategies convert a built GPT in place by swapping its child modules
    (`parallelize_tensor`, `parallelize_context`, `parallelize_experts` in
    minipar/parallel/): `position_ids`, `scatter_to_sequence_parallel`, `lm_head` and
    `lm_loss` are the places where embed and head differ between strategies.
    """

    def __init__(self, config: GPTConfig, seed: int = 0, precision: str = "fp64",
                 recompute: Recompute | None = None, *, layers: range | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 stage: int | None = None):
        super().__init__()
        self.config = config
        self.seed = seed
        self.policy = get_policy(precision)
        self.recompute = Recompute() if recompute is None else recompute
        self.layers = range(config.n_layer) if layers is None else layers
        self.pre_process, self.post_process = pre_process, post_process
        dtype = self.policy.param_dtype
        # One generator for every dropout mask, seeded apart from the weights (a pipeline
        # stage's apart from the others': with dropout its masks differ from one device's).
        stream = [seed, zlib.crc32(b"dropout")] + ([] if stage is None else [stage])
        self.dropout_generator = np.random.default_rng(stream)
        gen = self.dropout_generator
        d, vocab = config.d_model, config.vocab_size
        if pre_process:
            self.wte = Embedding(vocab, d, dtype=dtype)
            self.wpe = Embedding(config.seq_len, d, dtype=dtype)
            self.position_ids = PositionIds(config.seq_len)
            self.drop = Dropout(config.dropout, gen)
            self.scatter_to_sequence_parallel = Identity()
        self.h = ModuleList((Block(config, dtype=dtype, generator=gen,
                                   checkpoint_core_attention=self.recompute.selective,
                                   moe=config.is_moe_layer(i)) for i in self.layers),
                            start=self.layers.start)
        if post_process:
            self.ln_f = LayerNorm(d, dtype=dtype)
            self.lm_head = LMHead(vocab, d, tied=config.tie_embeddings, dtype=dtype)
            self.lm_loss = CrossEntropyLoss()
            if config.tie_embeddings and not pre_process:  # the last stage's own copy
                self.wte = Embedding(vocab, d, dtype=dtype)
        initialize_parameters(self, config, seed)

    @staticmethod
    def initial_state_dict(config: GPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
        """The full initial weights (fp64) by name, without building a model."""
        return {name: init_parameter(name, shape, config, seed)
                for name, shape in parameter_shapes(config).items()}

    @hook_point
    def embed(self, idx) -> Tensor:
        """Token plus position embeddings: idx (B, T) ints -> x (B, T, d). Per rank:
        under context parallelism idx holds my T/N tokens; under sequence parallelism
        x is my (B, T/t, d) piece."""
        idx = check_token_ids(idx)
        where = self.position_ids(idx.shape[1])
        x = self.drop(self.wte(idx) + self.wpe.weight[where])
        return self.scatter_to_sequence_parallel(x)

    @hook_point
    def head(self, x, targets=None):
        """Final LayerNorm and LM head: x (B, T, d) -> mean cross-entropy against
        targets (B, T), or the logits (B, T, V) when targets is None."""
        x = self.ln_f(x)
        tied = self.wte.weight if self.config.tie_embeddings else None
        if targets is None:
            return self.lm_head(x, tied, gather_output=True)
        return self.lm_loss(self.lm_head(x, tied), targets)

    def forward(self, x, targets=None):
        """x: idx (B, T) ints, or the previous stage's (B, T, d) output when this GPT
        has no embedding (not pre_process). Returns the loss (logits without targets),
        or without a head (not post_process) the (B, T, d) output of the blocks."""
        return self.body(self.embed(x) if self.pre_process else x, targets)

    def body(self, x, targets=None):
        """Everything after the embedding, on its (B, T, d) output x: the blocks, then
        the head and loss if post_process (a pipeline's split backward stops at x)."""
        generator = self.dropout_generator if self.config.dropout > 0 else None
        x = run_blocks(self.h, x, self.recompute, generator)
        # The LM loss; MoE blocks' aux losses join the gradients in backward (moe.py).
        return self.head(x, targets) if self.post_process else x
