"""What a transformer's shape implies: parameters, FLOPs and saved activations.

`ModelShape` describes a decoder-only transformer by the few choices that change the
counts: GPT-2 style (learned positions, LayerNorm with bias, GELU MLP of 4h, biases, tied
head) or Llama-2 style (rotary positions, RMSNorm, SwiGLU MLP of width d_ff, no biases,
grouped-query attention, untied head), or BLOOM (ALiBi, an extra LayerNorm on the
embedding).

Counts are per TP rank and per micro-batch of b sequences of s tokens, in the conventions
of minipar's own kernels (minipar/autograd/functional.py), so that the planner fed
minipar's model sizes predicts what the emulator measures:

    matmul (m, k) @ (k, n)      2mkn forward, 4mkn backward   (+ mn each for a bias)
    LayerNorm                    8 / 12 FLOPs per element     GELU   8 / 14
    residual add                 1 / 1                        softmax 5 / 4 per score
    cross-entropy                5 / 2 per logit              AdamW  14 per parameter
and minipar's convention for ops it does not have (RMSNorm 5 / 8, SwiGLU 5 / 8 per
hidden unit, RoPE 3 / 3 per rotated element). Elementwise work is under 2% of a real
model's FLOPs; the matmuls are what Narayanan et al. 2021 (eq. 3) count.

Saved activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", section 4.1, eq. 1-2): per layer and token the inputs of the
two norms, of the QKV, output, MLP-in and MLP-out projections, Q, K, V, the MLP hidden
activation and the (s x s) attention probabilities. minipar's fused attention keeps the
probabilities but not their dropped-out copy, so with dropout it saves 2as^2b bytes less
than their count; without dropout our count is exactly their 34sbh + 5as^2b minus the
three dropout terms (sbh + sbh + as^2b) and minus the dropout output (2as^2b), in 16-bit.
This module is long because one shape carries every family's counts (GPT-2, Llama,
BLOOM and the MoE structure: the MoE per-micro-batch counts are in plan/experts.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from math import inf

from minipar.nn.gpt import MLP_KINDS, TransformerSizes
from minipar.train.config import ModelSettings, check_model_size
from minipar.train.layout import check_booleans, check_integer_sizes

NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rope", "alibi")

# Elementwise FLOPs per element (forward, backward); see the module docstring.
NORM_FLOPS = {"layernorm": (8, 12), "rmsnorm": (5, 8)}
ACTIVATION_FLOPS = {"gelu": (8, 14), "swiglu": (5, 8)}
SOFTMAX_FLOPS = (5, 4)
CROSS_ENTROPY_FLOPS = (5, 2)
ROPE_FLOPS = (3, 3)
DROPOUT_FLOPS = (2, 2)
ADAMW_FLOPS_PER_PARAMETER = 14


@dataclass(frozen=True)
class ModelShape(TransformerSizes):
    """A decoder-only transformer's shape.

    n_layer, d_model (h), n_head (a), vocab_size (V), seq_len (s): as in GPT-2.
    n_kv_head: key/value heads (grouped-query attention, Ainslie et al. 2023); default
        n_head (multi-head attention). d_ff: MLP hidden width; default 4h.
    mlp: "gelu" (two matrices h x f) or "swiglu" (three: gate, up, down; Shazeer 2020).
    norm: "layernorm" (weight and bias) or "rmsnorm" (weight only; Zhang & Sennrich 2019).
    bias: linear layers have biases (GPT-2, BLOOM) or not (Llama).
    position: "learned" (a (s, h) table, GPT-2), "rope" or "alibi" (no parameters).
    embedding_norm: a norm right after the token embedding (BLOOM).
    tie_embeddings: the LM head is the token embedding (GPT-2, BLOOM) or its own (V, h).
    dropout: probability (0 = off; real pre-training runs use 0).
    moe_num_experts, moe_top_k, moe_capacity_factor, moe_layer_freq: a mixture of experts
        (minipar/nn/moe.py, the trainer's flags): layers 0, f, 2f, ... replace their MLP
        by E expert MLPs of this MLP's shape behind a top-k router (d x E, no bias);
        capacity factor None is a dropless MoE (Mixtral), planned as perfectly balanced.
        Their per-micro-batch counts are in plan/experts.py.
    """

    name: str = "custom"
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    vocab_size: int = 65
    seq_len: int = 32
    n_kv_head: int | None = None
    d_ff: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    position: str = "learned"
    embedding_norm: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    moe_num_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float | None = 1.0
    moe_layer_freq: int = 1

    def __post_init__(self) -> None:
        error = lambda name, message: ValueError(f"ModelShape.{name} {message}")  # noqa: E731
        check_integer_sizes(self, error)
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelShape.{name} must be a positive integer, got {value!r}")
        self.check_widths()
        for name, value, options in (("mlp", self.mlp, MLP_KINDS),
                                     ("norm", self.norm, NORM_KINDS),
                                     ("position", self.position, POSITION_KINDS)):
            if value not in options:
                raise ValueError(f"ModelShape.{name} must be one of {options}, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelShape.dropout must be in [0, 1), got {self.dropout}")
        if self.moe_num_experts:
            for name in ("moe_num_experts", "moe_top_k", "moe_layer_freq"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"ModelShape.{name} must be a positive integer, got "
                                     f"{value!r}")
            if self.moe_top_k > self.moe_num_experts:
                raise ValueError(f"ModelShape: moe_top_k={self.moe_top_k} exceeds "
                                 f"moe_num_experts={self.moe_num_experts}")
            if self.moe_capacity_factor is not None and not 0 < self.moe_capacity_factor < inf:
                raise ValueError("ModelShape.moe_capacity_factor must be a finite number > 0 "
                                 f"(or None: dropless), got {self.moe_capacity_factor!r}")
        check_model_size(self, error)
        check_booleans(self, ("bias", "embedding_norm", "tie_embeddings"), error)

    # ------------------------------------------------------------------ derived sizes
    def with_seq_len(self, seq_len: int) -> ModelShape:
        return replace(self, seq_len=seq_len)

    # ------------------------------------------------------------------ mixture of experts
    @property
    def is_moe(self) -> bool:
        return self.moe_num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Layer i's MLP is a mixture of experts (GPTConfig.is_moe_layer's pattern)."""
        return self.is_moe and i % self.moe_layer_freq == 0

    def moe_layers_in(self, start: int, stop: int) -> int:
        """MoE layers among layers start .. stop - 1 (a pipeline chunk's): the multiples
        of moe_layer_freq there, counted, not looped over (--n-layer 10**12 hung)."""
        if not self.is_moe or stop <= start:
            return 0
        f = self.moe_layer_freq
        return (stop + f - 1) // f - (start + f - 1) // f

    @property
    def n_moe_layers(self) -> int:
        return self.moe_layers_in(0, self.n_layer)

    def mlp_params(self, tp: int = 1) -> tuple[int, int]:
        """(split over TP, replicated) parameters of one MLP (or one expert) on a TP rank."""
        h = self.d_model
        split = h * self.mlp_in_width + self.ffn * h + (self.mlp_in_width if self.bias else 0)
        return split // tp, (h if self.bias else 0)

    @property
    def router_params(self) -> int:
        return self.d_model * self.moe_num_experts

    # ------------------------------------------------------------------ parameters
    def norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.d_model

    def layer_params(self, tp: int = 1) -> tuple[int, int]:
        """Parameters of one transformer layer on one TP rank: (split over TP, replicated).

        Megatron's split (Shoeybi et al. 2019, section 3): the QKV and MLP-in projections
        are column-parallel (weights and biases split), the output and MLP-out projections
        row-parallel (weights split, biases replicated); norms are replicated.
        """
        h = self.d_model
        split = h * self.qkv_width + h * h + h * self.mlp_in_width + self.ffn * h
        replicated = 2 * self.norm_params()
        if self.bias:
            split += self.qkv_width + self.mlp_in_width
            replicated += 2 * h
        return split // tp, replicated

    def embedding_params(self, tp: int = 1) -> tuple[int, int]:
        """(split, replicated) parameters of the embedding on one TP rank: the token table
        is split by vocabulary rows (vocabulary-parallel), positions and norm replicated."""
        replicated = (self.seq_len * self.d_model if self.position == "learned" else 0)
        if self.embedding_norm:
            replicated += self.norm_params()
        return padded_vocab(self.vocab_size, tp) // tp * self.d_model, replicated

    def head_params(self, tp: int = 1) -> tuple[int, int]:
        """(split, replicated) parameters after the last layer: the final norm, and the
        untied LM head (vocabulary-parallel). A tied head has no parameters of its own."""
        split = 0 if self.tie_embeddings else padded_vocab(self.vocab_size, tp) // tp
        return split * self.d_model, self.norm_params()

    @property
    def n_params(self) -> int:
        """Parameters of the whole model (tied embedding counted once)."""
        return (sum(self.embedding_params()) + self.n_layer * sum(self.layer_params())
                + sum(self.head_params()) + self.n_moe_layers * self._moe_extra_params(
                    self.moe_num_experts))

    @property
    def n_active_params(self) -> int:
        """Parameters a token uses: k experts of each MoE layer (Mixtral's 12.9B of 46.7B)."""
        return self.n_params - self.n_moe_layers * (self.moe_num_experts - self.moe_top_k
                                                    ) * sum(self.mlp_params())

    def _moe_extra_params(self, experts: int) -> int:
        """An MoE layer's parameters beyond a dense one's: the router and `experts`
        experts instead of one MLP."""
        return self.router_params + (experts - 1) * sum(self.mlp_params())

    @property
    def n_non_embedding_params(self) -> int:
        """Parameters of the transformer layers and final norm (Kaplan et al. 2020's N)."""
        return (self.n_layer * sum(self.layer_params()) + self.norm_params()
                + self.n_moe_layers * self._moe_extra_params(self.moe_num_experts))

    # ------------------------------------------------------------------ FLOPs
    def layer_flops(self, b: int, tp: int = 1, sequence_parallel: bool = False
                    ) -> tuple[float, float]:
        """(forward, backward) FLOPs of one layer on one TP rank for b sequences."""
        h, s, a, f = self.d_model, self.seq_len, self.n_head, self.ffn
        tokens = b * s
        replicated_tokens = tokens // tp if sequence_parallel else tokens
        matmul = self._linear_flops(tokens, tp)
        attention = 4 * b * a * s * s * self.head_dim / tp  # q k^T and p v
        scores = b * a * s * s / tp
        norm_f, norm_b = NORM_FLOPS[self.norm]
        act_f, act_b = ACTIVATION_FLOPS[self.mlp]
        forward = matmul + attention + SOFTMAX_FLOPS[0] * scores
        backward = 2 * matmul + 2 * attention + SOFTMAX_FLOPS[1] * scores
        # two norms and two residual adds on the (sequence-parallel or replicated) stream
        forward += (2 * norm_f + 2) * replicated_tokens * h
        backward += (2 * norm_b + 2) * replicated_tokens * h
        forward += act_f * tokens * f / tp
        backward += act_b * tokens * f / tp
        bias = self._bias_flops(tokens, replicated_tokens, tp)
        forward += bias
        backward += bias
        if self.position == "rope":
            rotated = tokens * (h + self.kv_dim) / tp
            forward += ROPE_FLOPS[0] * rotated
            backward += ROPE_FLOPS[1] * rotated
        if self.dropout > 0:  # the two residual dropouts (attention dropout is fused)
            forward += 2 * DROPOUT_FLOPS[0] * replicated_tokens * h
            backward += 2 * DROPOUT_FLOPS[1] * replicated_tokens * h
        return forward, backward

    def _linear_flops(self, tokens: int, tp: int) -> float:
        """The four linear layers' GEMMs, forward (each of backward's two as many)."""
        h = self.d_model
        return 2 * tokens * h * (self.qkv_width + h + self.mlp_in_width + self.ffn) / tp

    def _bias_flops(self, tokens: int, replicated_tokens: int, tp: int) -> float:
        """The biases' adds (their gradients' sums as many): column-parallel ones split,
        row-parallel ones on the (sequence-parallel or replicated) stream."""
        if not self.bias:
            return 0.0
        return (tokens * (self.qkv_width + self.mlp_in_width) / tp
                + 2 * replicated_tokens * self.d_model)

    def layer_weight_flops(self, b: int, tp: int = 1, sequence_parallel: bool = False
                           ) -> float:
        """Of layer_flops' backward, the weight gradients (the zero-bubble schedules' W,
        Qi et al. 2024, section 2): each linear layer's dW = x^T dy, as many FLOPs as its
        forward GEMM, and the biases' sums; the rest (dx through every op) is B."""
        tokens = b * self.seq_len
        replicated_tokens = tokens // tp if sequence_parallel else tokens
        return (self._linear_flops(tokens, tp)
                + self._bias_flops(tokens, replicated_tokens, tp))

    def head_weight_flops(self, b: int, tp: int = 1) -> float:
        """Of head_flops' backward, the logits GEMM's weight gradient (its W)."""
        vocab = padded_vocab(self.vocab_size, tp) // tp
        return 2 * b * self.seq_len * self.d_model * vocab

    def embedding_flops(self, b: int, tp: int = 1) -> tuple[float, float]:
        """(forward, backward) FLOPs of the embedding: the lookup's backward scatter-adds
        every token's gradient (b s h); learned positions add one (b s h) sum each way
        and the slice of the position table a (s, h) backward."""
        h, tokens = self.d_model, b * self.seq_len
        forward, backward = 0.0, float(tokens * h)
        if self.position == "learned":
            forward += tokens * h
            backward += tokens * h + self.seq_len * h
        if self.embedding_norm:
            forward += NORM_FLOPS[self.norm][0] * tokens * h
            backward += NORM_FLOPS[self.norm][1] * tokens * h
        if self.dropout > 0:
            forward += DROPOUT_FLOPS[0] * tokens * h
            backward += DROPOUT_FLOPS[1] * tokens * h
        return forward, backward

    def head_flops(self, b: int, tp: int = 1, sequence_parallel: bool = False
                   ) -> tuple[float, float]:
        """(forward, backward) FLOPs of the final norm, the logits and the cross-entropy."""
        h, tokens = self.d_model, b * self.seq_len
        vocab = padded_vocab(self.vocab_size, tp) // tp
        replicated_tokens = tokens // tp if sequence_parallel else tokens
        norm_f, norm_b = NORM_FLOPS[self.norm]
        forward = (norm_f * replicated_tokens * h + 2 * tokens * h * vocab
                   + CROSS_ENTROPY_FLOPS[0] * tokens * vocab)
        backward = (norm_b * replicated_tokens * h + 4 * tokens * h * vocab
                    + CROSS_ENTROPY_FLOPS[1] * tokens * vocab)
        return forward, backward

    def model_flops_per_sequence(self) -> float:
        """Model FLOPs of one sequence's forward and backward, without recomputation: three
        times the forward matmuls (Narayanan et al. 2021, eq. 3, which for a GPT shape is
        72 s L h^2 (1 + s/6h + V/12Lh) per sequence). The numerator of MFU (Chowdhery
        et al. 2022, PaLM, appendix B)."""
        h, s, f = self.d_model, self.seq_len, self.ffn
        per_layer = 2 * s * h * (self.qkv_width + h + self.mlp_in_width + f) + 4 * s * s * h
        # an MoE layer: each token through k experts, and the router (Fedus et al. 2022)
        moe = (self.moe_top_k - 1) * 2 * s * h * (self.mlp_in_width + f) + 2 * s * h * (
            self.moe_num_experts)
        return 3 * (self.n_layer * per_layer + self.n_moe_layers * moe
                    + 2 * s * h * self.vocab_size)

    # ------------------------------------------------------------------ activations
    def layer_activation_bytes(self, b: int, tp: int, sequence_parallel: bool,
                               activation_bytes: int, compute_bytes: int,
                               flash_attention: bool = False) -> int:
        """Bytes one layer saves for backward on one TP rank, for b sequences.

        Korthikanti et al. 2022, eq. 2 (tensor parallel) and section 4.2.2 (sequence
        parallel): the norms' inputs and the QKV / MLP-in inputs live on the replicated
        stream (1/t of it with sequence parallelism); Q, K, V, the probabilities, the
        output-projection input and the MLP hidden activations are split over t.
        """
        h, s, f = self.d_model, self.seq_len, self.ffn
        tokens = b * s
        stream = tokens // tp if sequence_parallel else tokens  # replicated-region tokens
        elements = 2 * stream * h  # the two norms' normalised inputs
        elements += 2 * stream * h  # inputs of the QKV and MLP-in projections
        elements += tokens * self.qkv_width // tp  # Q, K, V (attention's saved input)
        elements += tokens * h // tp  # the output projection's input
        hidden = 3 if self.mlp == "swiglu" else 2  # (gate, up) and product; or GELU in, out
        elements += hidden * tokens * f // tp
        nbytes = elements * activation_bytes + 2 * stream * compute_bytes  # norms' 1/std
        nbytes += self.attention_core_bytes(b, tp, activation_bytes, compute_bytes,
                                            flash_attention)
        if self.dropout > 0:  # boolean masks of the two residual dropouts
            nbytes += 2 * stream * h
        return nbytes

    def attention_core_bytes(self, b: int, tp: int, activation_bytes: int,
                             compute_bytes: int, flash_attention: bool = False) -> int:
        """What the attention core softmax(QK^T)V of my heads saves beyond its Q, K, V:
        the (s x s) probabilities (and with dropout their boolean mask), or with
        FlashAttention (Dao et al. 2022) only the log-sum-exp per row. The part selective
        recomputation drops (Korthikanti et al. 2022, section 5: the 5as^2b of their
        34sbh + 5as^2b, whose dropped-out copy minipar's fused kernel never keeps)."""
        s, local_heads = self.seq_len, self.n_head // tp
        if flash_attention:
            return b * local_heads * s * compute_bytes
        nbytes = b * local_heads * s * s * activation_bytes
        if self.dropout > 0:
            nbytes += b * local_heads * s * s
        return nbytes

    def attention_branch_bytes(self, b: int, tp: int, sequence_parallel: bool,
                               activation_bytes: int, compute_bytes: int) -> int:
        """What a layer still holds when its attention core's backward runs (the MLP
        half and the output projection are done): ln_1's normalised input and 1/std,
        the QKV projection's input, and Q, K, V."""
        tokens = b * self.seq_len
        stream = tokens // tp if sequence_parallel else tokens
        elements = 2 * stream * self.d_model + tokens * self.qkv_width // tp
        return elements * activation_bytes + stream * compute_bytes

    def qkv_bytes(self, b: int, tp: int, activation_bytes: int) -> int:
        """Q, K and V of my heads for b sequences: what a checkpointed attention core
        keeps, and the size of its input gradient."""
        return b * self.seq_len * self.qkv_width // tp * activation_bytes

    def attention_core_flops(self, b: int, tp: int = 1) -> float:
        """Forward FLOPs of the attention core of my heads (q k^T, softmax, p v): what
        selective recomputation runs again in backward."""
        s = self.seq_len
        scores = b * self.n_head * s * s / tp
        return 4 * scores * self.head_dim + SOFTMAX_FLOPS[0] * scores

    def layer_input_bytes(self, b: int, tp: int, sequence_parallel: bool,
                          activation_bytes: int) -> int:
        """The (b, s, h) input a checkpointed layer keeps (Korthikanti's 2sbh per layer
        with full recomputation; 1/t of it with sequence parallelism)."""
        stream = b * self.seq_len // (tp if sequence_parallel else 1)
        return stream * self.d_model * activation_bytes

    def embedding_activation_bytes(self, b: int, tp: int) -> int:
        """The token ids the lookup keeps (int64); vocabulary-parallel lookups keep their
        local ids and a boolean "not mine" mask instead."""
        tokens = b * self.seq_len
        nbytes = tokens * 8 + (tokens if tp > 1 else 0)
        if self.dropout > 0:
            nbytes += tokens * self.d_model
        return nbytes

    def head_activation_bytes(self, b: int, tp: int, sequence_parallel: bool,
                              activation_bytes: int, compute_bytes: int) -> int:
        """Final norm input and 1/std, the logits projection's input, the softmax of my
        vocabulary slice (b, s, V/t) and the targets (int64; plus a mask with TP)."""
        tokens = b * self.seq_len
        stream = tokens // tp if sequence_parallel else tokens
        vocab = padded_vocab(self.vocab_size, tp) // tp
        nbytes = (2 * stream * self.d_model + tokens * vocab) * activation_bytes
        nbytes += stream * compute_bytes + tokens * 8 + (tokens if tp > 1 else 0)
        return nbytes


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp, so that it splits (Megatron pads the
    same way; minipar's `--vocab-size` must already be a multiple)."""
    return -(-vocab_size // tp) * tp


def from_train_config(config, vocab_size: int | None = None) -> ModelShape:
    """The ModelShape of a minipar TrainConfig (GPT-2 architecture): its model settings
    that a shape has (all but the aux-loss coefficient, which changes no count)."""
    vocab = config.vocab_size if vocab_size is None else vocab_size
    if vocab is None:
        raise ValueError("from_train_config: the config has no vocab_size (it comes from the "
                         "data); pass vocab_size=")
    shared = [f.name for f in fields(ModelSettings) if f.name in ModelShape.__dataclass_fields__]
    values = {name: getattr(config, name) for name in shared}
    return ModelShape(name="minipar", **{**values, "vocab_size": vocab})
