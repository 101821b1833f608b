"""Ring attention equals full causal attention (fp64), and the ring's traffic is what
the algorithm sends."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd import functional as F
from minipar.autograd.tensor import Tensor
from minipar.parallel.context.layout import sequence_shard
from minipar.parallel.context.ring_attention import ring_attention

B, T, H, HD = 2, 16, 2, 4


def full_attention(qkv, dout):
    x = Tensor(qkv, requires_grad=True)
    out = F.causal_self_attention(x, HD)
    out.backward(dout)
    return out.data, x.grad


def ring_run(n, load_balance, qkv, dout):
    def rank_program():
        group = dist.new_group(range(n), "cp")
        r = dist.get_rank()
        x = Tensor(sequence_shard(qkv, r, n, load_balance), requires_grad=True)
        with dist.phase("forward"):
            out = ring_attention(x, HD, group, load_balance)
        out.backward(sequence_shard(dout, r, n, load_balance))
        return out.data, x.grad
    return dist.launch(rank_program, n, return_devices=True)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("load_balance", [True, False])
def test_ring_attention_equals_full_causal_attention_forward_and_backward(n, load_balance):
    rng = np.random.default_rng(0)
    qkv = rng.normal(size=(B, T, 3 * H * HD))
    dout = rng.normal(size=(B, T, H * HD))
    out, grad = full_attention(qkv, dout)
    results, _ = ring_run(n, load_balance, qkv, dout)
    for r, (local_out, local_grad) in enumerate(results):
        expected_out = sequence_shard(out, r, n, load_balance)
        expected_grad = sequence_shard(grad, r, n, load_balance)
        np.testing.assert_allclose(local_out, expected_out, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(local_grad, expected_grad, rtol=1e-11, atol=1e-13)


def test_ring_traffic_is_n_minus_1_kv_blocks_forward_and_twice_that_backward():
    n = 4
    rng = np.random.default_rng(1)
    qkv = rng.normal(size=(B, T, 3 * H * HD))
    dout = rng.normal(size=(B, T, H * HD))
    _, devices = ring_run(n, True, qkv, dout)
    kv_block = 2 * B * (T // n) * H * HD * 8  # K and V of my tokens, fp64
    for device in devices:
        sent = {"forward": 0, "backward": 0}
        for record in device.comm.records:
            assert record.group_kind == "cp"
            sent[record.phase] += record.sent_bytes
        # forward: N-1 hops of K/V; backward: N-1 hops of K/V and N-1 of dK/dV
        assert sent == {"forward": (n - 1) * kv_block, "backward": 2 * (n - 1) * kv_block}
