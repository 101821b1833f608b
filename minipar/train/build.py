"""One rank's share of the model on the device mesh, and how it runs one step.

The mesh decides what a rank builds (Megatron-LM's `get_model`; picotron's shape): a GPT
(pp = 1) or a Pipeline of GPT chunks over its layers (pp > 1), each converted by
construction, one strategy after the other, in place:

    model = GPT(config, ..., layers=..., pre_process=..., post_process=...)
    parallelize_tensor(model, ...)     # --tp: my slices of its matrices, vocabulary
    parallelize_context(model, ...)    # --cp: ring attention, my tokens' positions
    parallelize_experts(model, ...)    # --ep: my experts, the all-to-all dispatcher

and then the data-parallel engine wraps whatever parameters the rank ended up with,
over its DP group (minipar/train/engines.py: DDP, ZeRO-1/2, ZeRO-3; with --ep a pair,
dense over DP and experts over expert-data-parallel). Every rank builds its pieces from
the same full initial weights, so every layout starts where a single device starts.

    rank = build_rank_model(config, mesh)          # inside minipar.distributed.launch
    loss = rank.forward_backward(micro_batches)     # my DP rank's micro-batches of a step
    rank.engine.clip_grad_norm_(1.0); rank.engine.step(lr); rank.engine.zero_grad()

`check_layout` (which mixes run, and why the others are refused) is in mixes.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from minipar import distributed as dist
from minipar.autograd.placement import Replicate, shard
from minipar.autograd.precision import bfloat16, float32, float64
from minipar.nn import GPT
from minipar.nn.moe import MoE, set_aux_loss_scale
from minipar.parallel.context.model import parallelize_context
from minipar.parallel.data.ddp import accumulate_gradients_in
from minipar.parallel.expert.dispatch import parallelize_experts
from minipar.parallel.pipeline.model import Pipeline
from minipar.parallel.tensor.model import counts_once_in_norm, parallelize_tensor
from minipar.parallel.tensor.sequence_grads import (
    allreduce_sequence_parallel_grads,
    defer_gradient_reduction,
)
from minipar.train.config import TrainConfig, gpt_config
from minipar.train.engines import (
    data_parallel_engine,
    expert_data_parallel_engine,
    zero3_across_nodes,
)


def device_mesh(config: TrainConfig, **outside_a_launch) -> dist.DeviceMesh:
    """The run's device mesh, with the data-parallel sub-groups its sharding across nodes
    needs (HSDP's, the secondary partition's, qgZ's node levels: made up front on every
    rank, as torch.distributed asks). outside_a_launch: world_size and gpus_per_node."""
    return dist.DeviceMesh(
        dp=config.dp, pp=config.pp, tp=config.tp, cp=config.cp, ep=config.ep,
        dp_shard=config.hsdp_shard_size,
        dp_secondary=config.secondary_partition,
        dp_node_groups=config.zero_quantized_gradients, **outside_a_launch)

GRAD_DTYPES = {"bf16": bfloat16, "fp32": float32, "fp64": float64}


# ------------------------------------------------------------------ one rank's model
def build_model(config: TrainConfig, mesh: dist.DeviceMesh, **part) -> GPT:
    """My GPT, or with `part` (GPT's layers, pre_process, post_process, stage) my
    pipeline chunk: built whole from the initial weights, then converted by each
    strategy of the layout in turn."""
    gpt = gpt_config(config)
    model = GPT(gpt, config.seed, config.precision, config.recompute, **part)
    if config.tp > 1:
        parallelize_tensor(model, gpt, mesh.tp_group(),
                           sequence_parallel=config.sequence_parallel)
    if config.cp > 1:
        parallelize_context(model, mesh.cp_group(), config.cp_load_balance)
    if config.ep > 1:  # my experts (under TP my slices; a stage its own layers' experts)
        parallelize_experts(model, mesh.ep_group(), mesh.ep_rank_of())
    return model


@dataclass
class RankModel:
    """What one rank trains: `model` (pp = 1) or `pipeline` (pp > 1), and its engine."""

    mesh: dist.DeviceMesh
    engine: object
    model: GPT | None = None
    pipeline: Pipeline | None = None
    overlap_grad_reduce: bool = True
    sequence_parallel_params: list = field(default_factory=list)  # deferred TP sums
    _moe_layers: list | None = field(default=None, init=False, repr=False)

    def finalize_model_grads(self) -> None:
        """Megatron's finalize_model_grads after the DP sync: SP's one TP all-reduce."""
        with dist.phase("backward"):
            allreduce_sequence_parallel_grads(self.sequence_parallel_params, self.engine,
                                              self.mesh.tp_group())

    def forward_backward(self, micro_batches: list[tuple[np.ndarray, np.ndarray]]) -> float:
        """Forward and backward of one optimizer step's micro-batches (this DP rank's),
        gradients averaged over DP, then `finalize_model_grads`; returns the mean (LM) loss."""
        engine = self.engine
        # Each loss is seeded 1/m, so MoE aux losses weigh 1/m too (Megatron's set_loss_scale)
        if self.moe_layers():
            for part in self.parts():
                set_aux_loss_scale(part, 1.0 / len(micro_batches))
        if self.pipeline is not None:
            # The schedule runs every backward. With overlap, the engine's hooks reduce
            # each chunk's buckets during its last backward (Megatron's
            # --overlap-grad-reduce), the tied embedding's after its copies are summed;
            # without, every bucket waits for the flush.
            engine.require_backward_grad_sync = False
            grad_sync = None
            if self.overlap_grad_reduce:
                def grad_sync(enabled: bool) -> None:
                    engine.require_backward_grad_sync = enabled
            loss = self.pipeline.forward_backward(micro_batches, grad_sync=grad_sync)
            engine.require_backward_grad_sync = False
            with dist.phase("backward"):
                engine.synchronize_gradients()
            self.finalize_model_grads()
            return loss
        accum, losses = len(micro_batches), []
        for k, (x, y) in enumerate(micro_batches):
            # Only the last micro-batch's backward reduces gradients (DDP's no_sync);
            # ZeRO-2/3 reduce-scatter every micro-batch (DeepSpeed).
            engine.require_backward_grad_sync = k == accum - 1
            with dist.phase("forward"):
                loss = self.model(x, y)
            # d(mean over the global batch)/d(loss_k) = 1 / (accum x dp); the DP average
            # supplies the 1 / dp. (The engine's hooks reduce during backward, which the
            # autograd engine charges to the backward phase; here we only wait.)
            loss.backward(np.asarray(1.0 / accum, dtype=loss.data.dtype))
            with dist.phase("backward"):  # DDP waits in its end-of-backward callback
                engine.finish_gradient_synchronization()
            losses.append(float(loss.data))
        self.finalize_model_grads()
        return float(np.mean(losses))

    def parts(self) -> list:
        """The modules this rank runs: its model, or its pipeline chunks."""
        return [self.model] if self.pipeline is None else list(self.pipeline.chunks)

    def moe_layers(self) -> list[tuple[str, MoE]]:
        """(global name such as "h.2.mlp", MoE) of the MoE layers this rank holds (looked
        up once: what a rank runs does not change after it is built, and the training
        loop asks at every step)."""
        if self._moe_layers is None:
            self._moe_layers = [(name, m) for part in self.parts()
                                for name, m in part.named_modules() if isinstance(m, MoE)]
        return self._moe_layers

    def routing(self) -> list[dict]:
        """Each MoE layer's routing totals on this rank (minipar/nn/moe.py), by name."""
        return [{"name": name, **m.routing_totals} for name, m in self.moe_layers()]

    def aux_loss_total(self) -> float:
        """The aux losses of my MoE layers summed over every training forward so far."""
        return sum(m.routing_totals["aux_loss"] for _, m in self.moe_layers())

    def named_parameters(self) -> list:
        """(name, Parameter) of what this rank holds (its model or pipeline chunks)."""
        source = self.pipeline if self.pipeline is not None else self.model
        return list(source.named_parameters())

    @property
    def dropout_generator(self) -> np.random.Generator:
        """The generator of my dropout masks (a pipeline rank's first chunk's)."""
        if self.pipeline is not None:
            return self.pipeline.chunks[0].dropout_generator
        return self.model.dropout_generator


def build_rank_model(config: TrainConfig, mesh: dist.DeviceMesh, start=None) -> RankModel:
    """My share of the model (initial weights, or `start`'s: a checkpoint.TrainingState)
    and the DP / ZeRO engine over it. Call inside a launch, on every rank."""
    tp_group, pp_group = mesh.tp_group(), mesh.pp_group()
    model = pipeline = None
    if config.pp == 1:
        model = build_model(config, mesh)
    else:
        pipeline = Pipeline(gpt_config(config), pp_group=pp_group, schedule=config.schedule,
                            micro_batches=config.grad_accum_steps,
                            virtual_stages=config.virtual_stages,
                            build_chunk=functools.partial(build_model, config, mesh))
    named = list((model if pipeline is None else pipeline).named_parameters())
    accumulate_gradients_in((p for _, p in named), GRAD_DTYPES[config.grad_dtype])
    if start is not None:
        load_local_state(named, start.tensors["param"], mesh)
    tp_rank = mesh.tp_rank

    def counts_in_norm(param) -> bool:
        # Each element of the full model once: TP replicas on TP rank 0 (tensor/model.py), a
        # tied embedding on the first pipeline stage (Pipeline.counts_in_norm).
        return ((pipeline is None or pipeline.counts_in_norm(param))
                and counts_once_in_norm(param, tp_rank))

    adamw = {"lr": config.lr, "betas": (config.beta1, config.beta2),
             "weight_decay": config.weight_decay}
    # Parameters are replicated over CP too: average their gradients (and shard ZeRO's
    # states) over DP x CP, Megatron's data-parallel group with context parallelism;
    # ZeRO-3 across nodes may shard over a part of it (HSDP).
    replicas, across_nodes = zero3_across_nodes(config, mesh)
    if config.ep > 1:  # (MoE with cp > 1, zero >= 2 or offload: refused by mixes.check_layout)
        engine = expert_data_parallel_engine(config, model, named, mesh, adamw,
                                             counts_in_norm)
    else:
        engine = data_parallel_engine(model, named, replicas, zero_stage=config.zero,
                                      bucket_bytes=config.bucket_size_mb * 2**20,
                                      adamw=adamw, norm_groups=(tp_group, pp_group),
                                      counts_in_norm=counts_in_norm,
                                      overlap_comm=config.overlap_grad_reduce,
                                      zero3_prefetch=config.zero3_prefetch,
                                      offload_optimizer=config.offload_optimizer,
                                      offload_param=config.offload_param,
                                      across_nodes=across_nodes)
    if pipeline is not None:  # a tied wte's gradient is final only after its copies sum
        # (or, in a V, after both of rank 0's chunks added into the one they share)
        engine.defer_reduction(pipeline.late_reduced_parameters())
    rank = RankModel(mesh, engine, model, pipeline, config.overlap_grad_reduce)
    if config.sequence_parallel and config.offload_optimizer == "none":  # (else f sums)
        rank.sequence_parallel_params = defer_gradient_reduction(named)
    if start is not None:
        engine.load_optimizer_state(start.step, local_state(named, start.tensors, mesh))
        # My saved dropout-generator state (rank 0's if the checkpoint had fewer ranks).
        rngs, me = start.rng_states, dist.get_rank()
        rank.dropout_generator.bit_generator.state = rngs[me if me < len(rngs) else 0]
    return rank


def local_piece(full: np.ndarray, param, mesh: dist.DeviceMesh) -> np.ndarray:
    """My piece of the full tensor `full` of `param` (its placement over its group)."""
    if isinstance(param.placement, Replicate):
        return full
    group = param.placement_group
    return shard(full, param.placement, mesh.coords()[group], getattr(mesh, group))


def load_local_state(named, full_params: dict[str, np.ndarray], mesh) -> None:
    """Set every parameter to its piece of the full single-device tensor."""
    for name, p in named:
        p.data[...] = local_piece(np.asarray(full_params[name]), p, mesh)


def local_state(named, tensors: dict[str, dict[str, np.ndarray]], mesh) -> dict:
    """{kind: {name: my piece}} of full optimizer-state tensors (exp_avg, exp_avg_sq,
    master), for `engine.load_optimizer_state`."""
    by_name = dict(named)
    return {kind: {name: local_piece(np.asarray(full), by_name[name], mesh)
                   for name, full in values.items() if name in by_name}
            for kind, values in tensors.items()}
