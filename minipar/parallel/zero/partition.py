"""What one ZeRO rank keeps of one flat bucket: its partition (Rajbhandari et al. 2020,
section 5: rank r owns the r-th of N equal pieces of the flat parameters, gradients and
optimizer state; DeepSpeed's flat partitions, PyTorch FSDP's FlatParameter shard).

Each array's role decides how the rank's memory ledger books it, declared here once
(minipar/parallel/booking.py): the algorithms (sharded.py, stage_1_and_2.py, stage3.py)
assign and drop arrays, and the ledger follows.
"""

from __future__ import annotations

from minipar.parallel.booking import Held
from minipar.parallel.data.buckets import Bucket


class ShardedBucket:
    """This rank's part of one flat bucket, all (shard_numel,) arrays unless said.

    flat_params  stage 1/2: the full flat parameters (padded_numel,) every rank keeps
                 (the model's p.data are views of it)
    param_shard  stage 1/2: my piece of `flat_params` (a view); stage 3: the only
                 persistent copy of my parameters
    gathered     stage 3: the all-gathered flat parameters (padded_numel,) while a
                 module needs them; prefetched: the same, its all-gather still running
                 (`prefetch_work`)
    secondary    stage 3 resharded to K ranks after forward (reshard.py: FSDP2's
                 reshard_after_forward=K, ZeRO++ hpZ): my (padded_numel / K,) piece of
                 the full parameters, which backward all-gathers over K ranks
    placeholders stage 3: the empty arrays p.data are between uses
    master       fp32 master weights (mixed precision only); exp_avg, exp_avg_sq: Adam
    grad_shard   my piece of the averaged gradient, None between steps (set-to-none):
                 the step's first reduce-scatter makes it, stage 2/3 accumulate the
                 later micro-batches into it, zero_grad drops it. Stage 1 keeps the full
                 p.grad until the step, so its shard is a buffer the step reads.
    segments     (start, stop, weight_decay) runs of the shard; padding is in none
    norm_segments  (start, stop) runs of the shard that count in the global gradient
                 norm (all of it, unless TP replicas or a tied copy must count once)
    """

    flat_params = Held("params")
    param_shard = Held("params")
    gathered = Held("buffers")
    prefetched = Held("buffers")
    secondary = Held("params")
    master = Held("optimizer")
    exp_avg = Held("optimizer")
    exp_avg_sq = Held("optimizer")
    grad_shard = Held("grads")

    def __init__(self, bucket: Bucket, shard: int, weight_decay: float,
                 counts_in_norm=None, *, partition_gradients: bool = True):
        self.booking: dict[str, tuple[str, str]] = {}
        if partition_gradients:
            # The full gradient lives only until it is reduce-scattered.
            for p in bucket.params:
                p.grad_category = "buffers"
        else:
            self.booking["grad_shard"] = ("buffers", "gpu")
        self.bucket, self.shard = bucket, shard
        self.start, self.stop = bucket.shard_range(shard)
        self.placeholders = self.prefetch_work = None
        self.segments = []
        self.norm_segments = []
        for i, _, _, lo, hi in bucket.overlaps(self.start, self.stop):
            if counts_in_norm is None or counts_in_norm(bucket.params[i]):
                _append_run(self.norm_segments, lo - self.start, hi - self.start)
            decay = weight_decay if len(bucket.shapes[i]) >= 2 else 0.0  # matrices only
            lo, hi = lo - self.start, hi - self.start
            if self.segments and self.segments[-1][1] == lo and self.segments[-1][2] == decay:
                self.segments[-1] = (self.segments[-1][0], hi, decay)
            else:
                self.segments.append((lo, hi, decay))

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def optimizer_states(self):
        """(kind, array) of the optimizer state this shard keeps (master only if mixed)."""
        return [(kind, array) for kind, array in (("master", self.master),
                                                  ("exp_avg", self.exp_avg),
                                                  ("exp_avg_sq", self.exp_avg_sq))
                if array is not None]


def _append_run(runs: list, lo: int, hi: int) -> None:
    """Append [lo, hi) to a list of (start, stop) runs, merging touching runs."""
    if runs and runs[-1][1] == lo:
        runs[-1] = (runs[-1][0], hi)
    else:
        runs.append((lo, hi))
