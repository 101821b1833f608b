"""A checker must say *what* is wrong: each test takes a reference solution, plants one
typical student mistake, and expects the checker to fail with a sentence that points at it
(and to pass everything the mistake does not touch)."""

from __future__ import annotations

import importlib
import re
import types

import numpy as np
import pytest

from exercises.checkers import find
from minipar import distributed as dist
from minipar.autograd import Function
from minipar.autograd import functional as F
from minipar.nn import adamw_update
from minipar.parallel.pipeline.actions import RecvGrad, SendActivation


def mutant(number: str, **overrides):
    """The reference solution of exercise `number` with some attributes replaced."""
    exercise = find(number)
    module = importlib.import_module(f"exercises.solutions.{exercise.module}")
    names = {k: getattr(module, k) for k in dir(module) if not k.startswith("__")}
    return exercise, types.SimpleNamespace(**{**names, **overrides})


def failures(number: str, **overrides) -> dict[str, str]:
    """{check name: detail} of the checks that fail on the mutant."""
    exercise, impl = mutant(number, **overrides)
    report = exercise.check(impl)
    assert not report.passed
    assert not report.not_implemented
    return {o.name: o.detail for o in report.outcomes if o.status == "fail"}


def only_failure(number: str, **overrides) -> str:
    found = failures(number, **overrides)
    assert len(found) == 1, found
    return next(iter(found.values()))


# ------------------------------------------------------------------ 01 ring all-reduce
def _ring(exchange, copy=True, neighbours=None):
    """A ring all-reduce whose per-step exchange is `exchange(out, successor, predecessor,
    group, i)`; with copy=False its chunks are views of x."""
    neighbours = neighbours or mutant("01")[1].ring_neighbours

    def ring_all_reduce(x, group=None):
        i, n, successor, predecessor = neighbours(group)
        chunks = np.array_split(x.reshape(-1), n)
        if copy:
            chunks = [c.copy() for c in chunks]
        for s in range(n - 1):
            chunks[(i - s - 1) % n] += exchange(chunks[(i - s) % n], successor, predecessor,
                                                group, i)
        for s in range(n - 1):
            chunks[(i - s) % n] = exchange(chunks[(i + 1 - s) % n], successor, predecessor,
                                           group, i)
        return np.concatenate(chunks).reshape(x.shape)
    return ring_all_reduce


def _overlapped(out, successor, predecessor, group, i):
    request = dist.isend(out, successor, group=group)
    incoming = dist.recv(predecessor, group=group)
    request.wait()
    return incoming


def test_01_blocking_sends_deadlock_and_the_checker_says_who_waits_for_whom():
    def blocking(out, successor, predecessor, group, i):
        dist.send(out, successor, group=group)
        return dist.recv(predecessor, group=group)

    text = only_failure("01", ring_all_reduce=_ring(blocking))
    assert "rank 0 waits send to 1" in text and "rank 1 waits send to 0" in text
    assert "isend" in text  # the hint names the fix


def test_01_alternating_send_and_recv_by_parity_is_correct_but_slower():
    def parity(out, successor, predecessor, group, i):
        if i % 2 == 0:
            dist.send(out, successor, group=group)
            return dist.recv(predecessor, group=group)
        incoming = dist.recv(predecessor, group=group)
        dist.send(out, successor, group=group)
        return incoming

    exercise, impl = mutant("01", ring_all_reduce=_ring(parity))
    report = exercise.check(impl)
    assert report.passed  # a warning does not fail the exercise
    (warning,) = [o for o in report.outcomes if o.status == "warn"]
    assert "the simulated time of dist.all_reduce" in warning.detail


def test_01_sending_the_whole_tensor_to_everyone_fails_bytes_and_pattern():
    def everyone(x, group=None):
        me = dist.get_rank()
        ranks = list(range(dist.get_world_size())) if group is None else list(group.ranks)
        requests = [dist.isend(x, r, group=group) for r in ranks if r != me]
        parts = {r: dist.recv(r, group=group) for r in ranks if r != me}
        for request in requests:
            request.wait()
        return sum((parts.get(r, x) for r in ranks), np.zeros_like(x))

    detail = failures("01", ring_all_reduce=everyone)
    assert set(detail) == {"only send/recv, and only to a ring neighbour",
                           "bytes: 2(n-1)/n*S per rank, what dist.all_reduce books"}
    assert "sent to ranks [1, 2]" in "".join(detail.values())
    assert "2(n-1)/n*S = 2*2/3*120 = 160" in "".join(detail.values())


def test_01_adding_into_views_of_x_changes_the_input():
    text = only_failure("01", ring_all_reduce=_ring(_overlapped, copy=False))
    assert "input x was changed" in text


def test_01_global_peers_on_a_sub_group_get_a_hint():
    def world_neighbours(group=None):
        n = dist.get_world_size() if group is None else group.size
        i = dist.get_rank(group)
        return i, n, (i + 1) % n, (i - 1) % n  # positions, not global ranks

    text = only_failure("01", ring_all_reduce=_ring(_overlapped, neighbours=world_neighbours))
    assert "peers of send/recv are still global ranks" in text
    # the only hint: a peer outside the group is no shape error of a chunk index
    assert text.count("hint:") == 1 and "shape error" not in text
    assert text.splitlines()[-1].startswith("  hint: on a sub-group")  # after the rank


def test_01_the_library_collective_is_refused(tmp_path):
    from exercises.checkers.worker import load_implementation

    path = tmp_path / "ex01_ring_allreduce.py"
    path.write_text("from minipar import distributed as dist\n\n"
                    "def ring_all_reduce(x, group=None):\n"
                    "    return dist.all_reduce(x, group=group)\n")
    exercise = find("01")
    report = exercise.check(load_implementation(exercise, file=str(path)))
    failed = {o.name: o.detail for o in report.outcomes if o.status == "fail"}
    assert "all_reduce (line 4)" in failed["uses only send / recv / isend / irecv"]
    assert "rank 0 called all_reduce" in failed["only send/recv, and only to a ring neighbour"]


# ------------------------------------------------------------------ 02 tensor parallel
def test_02_bias_added_on_every_rank_before_g():
    _, sol = mutant("02")
    text = failures("02", row_parallel_linear=lambda x, w, b, group: sol.g(F.linear(x, w, b),
                                                                           group))
    assert any("X A + t*b" in d for d in text.values())


def test_02_missing_f_leaves_a_partial_input_gradient_and_no_backward_all_reduce():
    detail = failures("02", column_parallel_linear=lambda x, w, b, group: F.linear(x, w, b))
    texts = "\n".join(detail.values())
    assert "x must enter through f" in texts
    assert "backward made 0 all-reduces" in texts


def test_02_g_that_all_reduces_in_backward_too():
    class BothWays(Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return dist.all_reduce(x, group=group)

        @staticmethod
        def backward(ctx, grad):
            return dist.all_reduce(grad, group=ctx.group), None

    text = only_failure("02", g=lambda x, group: BothWays.apply(x, group))
    assert "g's backward must be the identity" in text


def test_02_row_shard_that_splits_columns():
    _, sol = mutant("02")
    text = only_failure("02", row_shard=sol.column_shard)
    assert "row-parallel splits the input dimension" in text


# ------------------------------------------------------------------ 03 data parallel
def _dp_step(op="avg", scale=True, per_micro_batch=False, zero_grad=True,
             zero_grad_per_micro_batch=False):
    def train_step(model, optimizer, micro_batches, group):
        params = list(model.parameters())

        def reduce():
            flat = dist.all_reduce(np.concatenate([p.grad.reshape(-1) for p in params]),
                                   op=op, group=group)
            offset = 0
            for p in params:
                p.grad[...] = flat[offset:offset + p.size].reshape(p.shape)
                offset += p.size

        losses = []
        for x, y in micro_batches:
            if zero_grad_per_micro_batch:
                optimizer.zero_grad()  # drops the micro-batches before this one
            loss = model(x, y)
            loss.backward(np.asarray(1.0 / len(micro_batches) if scale else 1.0))
            losses.append(float(loss.data))
            if per_micro_batch:
                reduce()
        if not per_micro_batch:
            reduce()
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()
        return float(np.mean(losses))
    return train_step


def test_03_summing_instead_of_averaging_is_named():
    detail = failures("03", train_step=_dp_step(op="sum"))
    assert any("factor N: sum -> average" in d for d in detail.values())


def test_03_missing_one_over_a_is_named():
    detail = failures("03", train_step=_dp_step(scale=False))
    assert any("scale each micro-batch's loss by 1/A" in d for d in detail.values())


GRADIENTS_03 = "gradients at optimizer.step() = single-device gradients of the global batch"
PARAMETERS_03 = "parameters after each step = single-device training; replicas identical"
LOSS_03 = "returned loss: its mean over ranks = the global batch's loss"


@pytest.mark.parametrize("mistake", [dict(op="sum"), dict(scale=False),
                                     dict(op="sum", scale=False)],
                         ids=["sum", "no-1/A", "sum-and-no-1/A"])
def test_03_a_wrong_gradient_is_not_blamed_on_the_returned_loss(mistake):
    """The loss of step 1 differs from single-device training only because step 0 stepped
    with the wrong gradient: the returned mean is right and the loss check must not send
    the student after it; the parameters' difference is named as the consequence."""
    exercise, impl = mutant("03", train_step=_dp_step(**mistake))
    report = exercise.check(impl)
    outcomes = {o.name: o for o in report.outcomes}
    assert outcomes[GRADIENTS_03].status == "fail"
    assert "return the mean over this rank's micro-batches" not in report.render()
    loss = outcomes[LOSS_03]
    assert loss.status == "pass", loss.detail
    assert "follows from the step-0 gradients above" in loss.detail
    assert "follows from the step-0 gradients above" in outcomes[PARAMETERS_03].detail


def test_03_a_wrong_returned_loss_is_still_named_when_the_gradients_are_wrong_too():
    wrong_gradient = _dp_step(op="sum")

    def train_step(model, optimizer, micro_batches, group):
        return 2 * wrong_gradient(model, optimizer, micro_batches, group)

    detail = failures("03", train_step=train_step)
    assert "return the mean over this rank's micro-batches" in detail[LOSS_03]


@pytest.mark.parametrize("scale", [True, False], ids=["scaled", "unscaled"])
def test_03_zero_grad_inside_the_micro_batch_loop_is_named(scale):
    detail = failures("03", train_step=_dp_step(scale=scale, zero_grad_per_micro_batch=True))
    assert ("only the last micro-batch's gradient is left: zero the gradients once per "
            "step, before the micro-batch loop (DDP's no_sync accumulates)"
            in detail[GRADIENTS_03])
    assert "follows from the step-0 gradients above" in detail[PARAMETERS_03]
    assert LOSS_03 not in detail


def test_03_reducing_every_micro_batch_breaks_no_sync():
    detail = failures("03", train_step=_dp_step(per_micro_batch=True))
    assert any("between micro-batches 0 and 1" in d for d in detail.values())
    assert any("3 all-reduces in one step" in d for d in detail.values())


def test_03_forgetting_zero_grad():
    detail = failures("03", train_step=_dp_step(zero_grad=False))
    assert any("call optimizer.zero_grad()" in d for d in detail.values())


# ------------------------------------------------------------------ 04 ZeRO-2
def _zero2(**methods):
    _, sol = mutant("04")
    return type("Mutant", (sol.Zero2AdamW,), methods)


def test_04_weight_decay_on_biases_is_named():
    def update_shard(self):
        shard = self.flatten([p.data for p in self.params])[self.start:self.stop].copy()
        adamw_update(shard, self.grad_shard, self.exp_avg, self.exp_avg_sq, self.step_count,
                     self.lr, *self.betas, self.eps, 0.1)
        return shard

    text = only_failure("04", Zero2AdamW=_zero2(update_shard=update_shard))
    assert "weight decay applies to matrices only" in text


def test_04_full_gradients_left_in_the_ledger():
    def reduce_scatter_gradients(self):
        flat = self.flatten([p.grad for p in self.params])
        self.grad_shard[...] = dist.reduce_scatter(flat, op="avg", group=self.group)
        for p in self.params:
            p.grad = None  # dropped, but not released from the ledger

    text = only_failure("04", Zero2AdamW=_zero2(
        reduce_scatter_gradients=reduce_scatter_gradients))
    assert "the ledger holds 792 bytes of gradients" in text  # Ψ = 66 fp64 gradients
    assert "release_grad" in text


def test_04_all_reduce_instead_of_reduce_scatter():
    def reduce_scatter_gradients(self):
        flat = self.flatten([p.grad for p in self.params])
        averaged = dist.all_reduce(flat, op="avg", group=self.group)
        self.grad_shard[...] = averaged[self.start:self.stop]
        for p in self.params:
            p.release_grad()

    text = only_failure("04", Zero2AdamW=_zero2(
        reduce_scatter_gradients=reduce_scatter_gradients))
    assert "all_reduce in the step" in text


def test_04_replicated_moments():
    def allocate_state(self):
        self.exp_avg = np.zeros(self.padded_numel, self.dtype)
        self.exp_avg_sq = np.zeros(self.padded_numel, self.dtype)
        self.grad_shard = np.zeros(self.shard_numel, self.dtype)
        for array, category in ((self.exp_avg, "optimizer"), (self.exp_avg_sq, "optimizer"),
                                (self.grad_shard, "grads")):
            self.memory.hold(array, category)

    def update_shard(self):
        shard = self.flatten([p.data for p in self.params])[self.start:self.stop].copy()
        m, v = self.exp_avg[self.start:self.stop], self.exp_avg_sq[self.start:self.stop]
        adamw_update(shard, self.grad_shard, m, v, self.step_count, self.lr, *self.betas,
                     self.eps, self.weight_decay)
        return shard

    text = only_failure("04", Zero2AdamW=_zero2(allocate_state=allocate_state,
                                                update_shard=update_shard))
    assert "for this rank's shard only" in text


# ------------------------------------------------------------------ 05 1F1B
def _lists(edit):
    _, sol = mutant("05")
    return lambda pp, m: edit(sol.one_f_one_b(pp, m))


def test_05_gpipe_order_is_not_1f1b():
    def gpipe(pp, m, stage):
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]

    detail = failures("05", compute_order=gpipe)
    assert "expected F0 B0 F1 B1 F2 B2" in detail[next(iter(detail))]


def test_05_a_missing_receive_deadlocks_and_is_named():
    def drop_last_recv_grad(lists):
        receives = [a for a in lists[0] if isinstance(a, RecvGrad)]
        if receives:  # (p = 1 has none)
            lists[0].remove(receives[-1])
        return lists

    detail = failures("05", one_f_one_b=_lists(drop_last_recv_grad))
    texts = "\n".join(detail.values())
    assert "its output gradient was not received first" in texts
    assert "deadlock: rank 1 waits send to 0" in texts


def test_05_sends_in_the_wrong_order_deliver_the_wrong_message():
    def swap_first_sends(lists):
        sends = [k for k, a in enumerate(lists[0]) if isinstance(a, SendActivation)][:2]
        if len(sends) == 2:
            a, b = sends
            lists[0][a], lists[0][b] = lists[0][b], lists[0][a]
        return lists

    detail = failures("05", one_f_one_b=_lists(swap_first_sends))
    assert any("arrive in the order they are sent" in d for d in detail.values())


# ------------------------------------------------------------------ 06 predict bytes
def _predict(change):
    _, sol = mutant("06")

    def predict_rank(config, rank):
        return change(config, rank, sol.predict_rank(config, rank))
    return predict_rank


def test_06_forgetting_ln_f_in_the_count():
    _, sol = mutant("06")
    text = only_failure("06", count_parameters=lambda c: sol.count_parameters(c)
                        - 2 * c.d_model)
    assert "missing ln_f" in text


def test_06_zero2_reduce_scatter_once_per_step_instead_of_per_micro_batch():
    _, sol = mutant("06")

    def as_zero1(config, rank, predicted):
        if config.zero == 2:
            predicted["dp"] = sol.predict_rank(config.replace(zero=1), rank)["dp"]
        return predicted

    text = only_failure("06", predict_rank=_predict(as_zero1))  # only the A = 2 run differs
    assert "dp predicted" in text and "(measured by collective: reduce_scatter" in text


def test_06_zero1_optimizer_state_left_replicated():
    def replicated(config, rank, predicted):
        if config.zero == 1:
            predicted["optimizer"] *= config.dp
        return predicted

    detail = failures("06", predict_rank=_predict(replicated))
    assert len(detail) == 2  # the two ZeRO-1 runs
    assert all("is it replicated at ZeRO-1?" in d for d in detail.values())


def test_06_ignoring_the_gradient_norm_all_reduce():
    def no_norm(config, rank, predicted):
        if config.zero and config.dp > 1:
            predicted["dp"] -= config.steps * dist.all_reduce_bytes(1, 8, config.dp,
                                                                    rank // config.tp)[0]
        return predicted

    detail = failures("06", predict_rank=_predict(no_norm))
    assert len(detail) == 5  # every run with ZeRO
    assert all("the gradient-norm all-reduce?" in d for d in detail.values())


def test_06_forgetting_the_lm_heads_backward_all_reduce_under_tp():
    def no_head_f(config, rank, predicted):
        if config.tp > 1:
            activation = config.micro_batch_size * config.seq_len * config.d_model * 4
            predicted["tp"] -= (config.steps * config.grad_accum_steps * 2
                                * (config.tp - 1) * activation // config.tp)
        return predicted

    detail = failures("06", predict_rank=_predict(no_head_f))
    assert len(detail) == 2  # the two TP runs
    assert all("tp predicted" in d for d in detail.values())


# ------------------------------------------------------------------ 07 zero bubble
def test_07_an_untransposed_weight_is_named():
    detail = only_failure("07", linear_backward_input=lambda g, w: g @ w)
    assert "g @ W^T" in detail


def test_07_a_bias_gradient_summed_over_the_first_axis_only_is_named():
    _, sol = mutant("07")

    def first_axis_bias(x, g):
        grad_w, _ = sol.linear_backward_weight(x, g)
        return grad_w, g.sum(axis=0)  # right for 2D x, (s, out) for (b, s, in)

    detail = only_failure("07", linear_backward_weight=first_axis_bias)
    assert "sum g over every axis but the last" in detail


def test_07_w_right_after_i_is_1f1b_with_a_split_backward():
    _, sol = mutant("07")

    def no_delay(pp, m, rank):
        return sol.zb_h1_compute_order(pp, m, 0) if rank == 0 else [
            step for kind, i in _one_f_one_b_split(pp, m, rank) for step in [(kind, i)]]

    detail = failures("07", zb_h1_compute_order=no_delay)
    assert "delays its W's by r" in "\n".join(detail.values())


def test_07_every_w_at_the_end_holds_m_micro_batches():
    _, sol = mutant("07")

    def all_w_last(pp, m, rank):
        order = [step for step in sol.zb_h1_compute_order(pp, m, rank) if step[0] != "W"]
        return order + [("W", i) for i in range(m)]

    detail = failures("07", zb_h1_compute_order=all_w_last)
    assert "all W's at the end" in "\n".join(detail.values())


def _one_f_one_b_split(pp, m, rank):
    """1F1B with each B split into I and an immediate W."""
    _, sol = mutant("05")
    order = []
    for kind, i in sol.compute_order(pp, m, rank):
        order += [("F", i)] if kind == "F" else [("I", i), ("W", i)]
    return order


@pytest.mark.parametrize("number", ["01", "02", "03", "04", "05", "06", "07"])
def test_an_error_in_the_code_under_test_is_a_failure_with_its_place(number):
    """Not a traceback wall: the error, the file and line, the rank."""
    exercise = find(number)
    module = importlib.import_module(f"exercises.solutions.{exercise.module}")
    broken = {k: getattr(module, k) for k in dir(module) if not k.startswith("__")}

    def boom(*args, **kwargs):
        raise ZeroDivisionError("planted")

    for name in ("ring_all_reduce", "column_parallel_linear", "train_step", "Zero2AdamW",
                 "one_f_one_b", "predict_rank", "zb_h1_compute_order"):
        if name in broken:
            broken[name] = boom
    report = exercise.check(types.SimpleNamespace(**broken))
    failed = [o for o in report.outcomes if o.status == "fail"]
    assert failed and not report.not_implemented
    assert any("ZeroDivisionError: planted" in o.detail for o in failed)


# ------------------------------------------------------------------ naming the mistake
def _ring_with(reduce_into, gather_send, gather_into):
    """A ring all-reduce with the chunk index of each phase given as f(i, s, n)."""
    neighbours = mutant("01")[1].ring_neighbours

    def ring_all_reduce(x, group=None):
        i, n, successor, predecessor = neighbours(group)
        chunks = [c.copy() for c in np.array_split(x.reshape(-1), n)]
        for s in range(n - 1):
            chunks[reduce_into(i, s, n)] += _overlapped(chunks[(i - s) % n], successor,
                                                        predecessor, group, i)
        for s in range(n - 1):
            chunks[gather_into(i, s, n)] = _overlapped(chunks[gather_send(i, s, n)], successor,
                                                       predecessor, group, i)
        return np.concatenate(chunks).reshape(x.shape)
    return ring_all_reduce


def test_01_an_all_gather_with_the_reduce_scatters_indices_names_phase_and_chunk():
    wrong = _ring_with(lambda i, s, n: (i - s - 1) % n,  # reduce-scatter: right
                       lambda i, s, n: (i - s) % n,  # all-gather: the reduce-scatter's
                       lambda i, s, n: (i - s - 1) % n)
    text = only_failure("01", ring_all_reduce=wrong)
    # n=2: position 0 holds the complete chunk 1 after the reduce-scatter, and sent its
    # own chunk 0 (only its own input in it)
    assert ("first wrong message: all-gather step 0, rank 0 sent chunk 0 summed over "
            "ranks [0]; expected chunk 1 complete") in text
    assert "in all-gather step s it sends chunk (i + 1 - s) mod n" in text


def test_01_a_reduce_scatter_adding_into_the_wrong_chunk_is_an_error_in_the_students_line():
    wrong = _ring_with(lambda i, s, n: (i - s) % n,  # adds into the chunk it just sent
                       lambda i, s, n: (i + 1 - s) % n, lambda i, s, n: (i - s) % n)
    exercise, impl = mutant("01", ring_all_reduce=wrong)
    report = exercise.check(impl)
    (failed,) = [o for o in report.outcomes if o.status == "fail"]
    assert failed.raised  # under its own label, not "runs without deadlock"
    assert failed.name.startswith("your code raised ValueError (while checking: runs")
    assert "ERROR your code raised ValueError" in report.render()
    assert "could not be broadcast" in failed.detail  # the error itself
    assert "in ring_all_reduce(): chunks[reduce_into(i, s, n)] +=" in failed.detail  # its line
    assert "(case n=4, shape (19,), float64)" in failed.detail
    assert "receives chunk (i - s - 1) mod n" in failed.detail  # the hint names the index
    assert "here the chunks differ in length (5, 5, 5, 4)" in failed.detail
    assert "peers of send/recv" not in failed.detail  # only the hint whose cause this is
    assert report.render().endswith("1 ERROR. Fix the first ERROR above and run the "
                                    "checker again.")


def test_01_the_same_mistake_on_even_chunks_names_the_reduce_scatter_step():
    _, impl = mutant("01", ring_all_reduce=_ring_with(lambda i, s, n: (i - s) % n,
                                                      lambda i, s, n: (i + 1 - s) % n,
                                                      lambda i, s, n: (i - s) % n))
    from exercises.checkers.ex01_ring_allreduce import Case, Run, _first_wrong_message

    case = Case(3, (3, 5))
    inputs = np.random.default_rng(0).standard_normal((3, 3, 5))
    text = _first_wrong_message(impl, Run(case, inputs, [], []))
    # step 0 added the predecessor's chunk 2 into chunk 0 (the one just sent), so step 1
    # sends chunk 2 with only rank 0's own input in it
    assert ("first wrong message: reduce-scatter step 1, rank 0 sent chunk 2 summed over "
            "ranks [0]; expected chunk 2 summed over ranks [0, 2]") in text
    assert "rank 2's contribution was not added into it" in text


def _zero2_grad(scale):
    def reduce_scatter_gradients(self):
        flat = self.flatten([p.grad for p in self.params])
        self.grad_shard[...] = dist.reduce_scatter(flat, op="avg", group=self.group)
        self.grad_shard *= scale(self.world)
        for p in self.params:
            p.release_grad()
    return _zero2(reduce_scatter_gradients=reduce_scatter_gradients)


def test_04_averaging_twice_is_off_by_a_factor_of_n_and_adam_explains_the_small_drift():
    detail = failures("04", Zero2AdamW=_zero2_grad(lambda n: 1 / n))
    gradient = detail["grad_shard = my shard of the gradient averaged over the ranks"]
    assert "off by a factor of N = 2: 1/N of the average: it was averaged twice" in gradient
    assert "Adam's step m / (sqrt(v) + eps)" in gradient
    parameters = detail["parameters after every step = replicated AdamW (fp64)"]
    assert "the gradient shard is 0.5 x the right one" in parameters


def test_04_summing_is_off_by_a_factor_of_n():
    detail = failures("04", Zero2AdamW=_zero2_grad(lambda n: n))
    gradient = detail["grad_shard = my shard of the gradient averaged over the ranks"]
    assert "off by a factor of N = 2: N times the average: it was summed" in gradient


def test_04_shard_offsets_without_the_padding_name_the_padding():
    def update_shard(self):
        start = self.rank * (self.numel // self.world)  # Ψ/N: ignores the padding
        shard = self.flatten([p.data for p in self.params])[start:start + self.shard_numel]
        shard = shard.copy()
        adamw_update(shard, self.grad_shard, self.exp_avg, self.exp_avg_sq, self.step_count,
                     self.lr, *self.betas, self.eps, self.weight_decay)
        return shard

    text = only_failure("04", Zero2AdamW=_zero2(update_shard=update_shard))
    assert text.startswith("N=4:")  # N=2 has no padding and passes
    assert "only the run whose flat buffer is padded differs: Ψ = 66 is padded to Ψ' = 68" \
           in text


def test_06_a_pipeline_stage_without_its_tied_copy_of_wte():
    _, sol = mutant("06")

    def no_copy(config, rank, predicted):
        stage = (rank // config.tp) % config.pp
        if config.pp > 1 and config.tie_embeddings and stage == config.pp - 1:
            predicted["params"] -= config.vocab_size * config.d_model * 2  # bf16
        return predicted

    text = only_failure("06", predict_rank=_predict(no_copy))
    assert text.startswith("rank 1: params predicted")  # dp 0, stage 1
    assert "it keeps its own copy of wte" in text


def test_06_forgetting_the_embedding_groups_all_reduce_under_pp():
    def no_embedding_group(config, rank, predicted):
        stage = (rank // config.tp) % config.pp
        if config.pp > 1 and config.tie_embeddings and stage in (0, config.pp - 1):
            predicted["pp"] -= config.steps * config.vocab_size * config.d_model * 2
        return predicted

    text = only_failure("06", predict_rank=_predict(no_embedding_group))
    assert "the tied embedding's all-reduce between the first and the last stage" in text


def test_06_forgetting_the_loss_broadcast():
    def no_loss(config, rank, predicted):
        if config.pp > 1 and (rank // config.tp) % config.pp == config.pp - 1:
            predicted["pp"] -= 8 * config.steps
        return predicted

    detail = failures("06", predict_rank=_predict(no_loss))
    assert len(detail) == 2  # the two PP runs
    assert all("the loss the last stage broadcasts" in d for d in detail.values())


# ------------------------------------------------------------------ 08 ZeRO-3 prefetch
def _zero3(forward=None, backward=None):
    """zero3_actions whose forward part (or backward part) is `forward(units, prefetch)`
    (`backward(units, prefetch)`), the other part the solution's."""
    _, sol = mutant("08")

    def zero3_actions(units, prefetch):
        actions = sol.zero3_actions(units, prefetch)
        split = actions.index(("forward", units - 1)) + 2  # after the last forward's free
        return ((forward or (lambda *_: actions[:split]))(units, prefetch)
                + (backward or (lambda *_: actions[split:]))(units, prefetch))
    return zero3_actions


def test_08_never_freeing_after_forward_keeps_every_unit_gathered():
    def forward(units, prefetch):  # gather, wait, forward; never free
        return [a for u in range(units) for a in (("gather", u), ("wait", u), ("forward", u))]

    def backward(units, prefetch):  # everything is still there
        return [a for u in reversed(range(units)) for a in (("backward", u), ("free", u))]

    detail = failures("08", zero3_actions=_zero3(forward, backward))
    peak = detail["peak of gathered buffers: <= 2 units with prefetch, 1 without"]
    assert "3 units, N=2, prefetch=False: at the peak 3 units' full parameters" in peak
    assert "Units 0, 1, 2 stay gathered from their forward to their backward" in peak
    assert "ZeRO-2's memory, not ZeRO-3's" in peak


def test_08_prefetching_every_unit_at_the_start_holds_them_all():
    def forward(units, prefetch):
        return ([("gather", u) for u in range(units)]
                + [a for u in range(units) for a in (("wait", u), ("forward", u),
                                                      ("free", u))])

    text = only_failure("08", zero3_actions=_zero3(forward))
    assert "3 units, N=2, prefetch=False: at the peak 3 units' full parameters" in text
    assert "the running unit)" in text


def test_08_waiting_right_after_the_prefetch_hides_nothing():
    def eager(units, prefetch, order, kind):
        actions = [("gather", order[0]), ("wait", order[0])]
        for i, u in enumerate(order):
            if prefetch and i + 1 < len(order):
                actions += [("gather", order[i + 1]), ("wait", order[i + 1])]
            actions += [(kind, u), ("free", u)]
            if not prefetch and i + 1 < len(order):
                actions += [("gather", order[i + 1]), ("wait", order[i + 1])]
        return actions

    text = only_failure("08", zero3_actions=_zero3(
        lambda units, prefetch: eager(units, prefetch, list(range(units)), "forward"),
        lambda units, prefetch: eager(units, prefetch, list(reversed(range(units))),
                                      "backward")))
    assert "3 units, N=2, prefetch=True:" in text and "us of exposed communication" in text
    assert "Waited for: forward of unit 0 (1 all-gathers); forward of unit 1" in text
    assert "compute runs between its gather and its wait" in text


def test_08_backward_without_a_second_gather_is_named():
    def backward(units, prefetch):  # the forward freed every unit
        return [a for u in reversed(range(units)) for a in (("backward", u), ("free", u))]

    text = only_failure("08", zero3_actions=_zero3(backward=backward))
    assert "action 4 (backward 0): unit 0 is not gathered: its parameters were freed " \
           "after its forward; gather it again before its backward" in text


def test_08_computing_before_the_wait_is_named():
    def forward(units, prefetch):
        _, sol = mutant("08")
        actions = sol.zero3_actions(units, prefetch)
        actions = actions[:actions.index(("forward", units - 1)) + 2]
        actions.remove(("wait", 0))
        return actions[:actions.index(("forward", 0)) + 1] + [("wait", 0)] + \
            actions[actions.index(("forward", 0)) + 1:]

    text = only_failure("08", zero3_actions=_zero3(forward))
    assert "action 1 (forward 0): unit 0's all-gather was launched but not waited for" in text
    assert "Put ('wait', 0) before the forward" in text


def test_08_backward_prefetch_in_the_forward_direction_is_exposed_and_wasted():
    def backward(units, prefetch):
        actions = [("gather", units - 1)]
        for u in reversed(range(units)):
            actions.append(("wait", u))
            if prefetch and u + 1 < units:  # "the next unit" taken as u + 1, as in forward
                actions.append(("gather", u + 1))
            actions += [("backward", u), ("free", u)]
            if prefetch and u + 1 < units:
                actions.append(("free", u + 1))
            if u > 0:
                actions.append(("gather", u - 1))
        return actions

    detail = failures("08", zero3_actions=_zero3(backward=backward))
    assert set(detail) == {
        "exposed communication: every all-gather without prefetch, at most 2 with",
        "bytes: each unit gathered for its forward and for its backward"}
    exposed = detail["exposed communication: every all-gather without prefetch, at most 2 with"]
    assert "in backward the next unit is the previous one (u - 1)" in exposed
    assert "8 all-gathers of" in detail["bytes: each unit gathered for its forward and for "
                                        "its backward"]


def test_08_a_plan_padded_with_gathers_is_refused_before_it_runs():
    """A plan that gathers and frees a unit thousands of times passes the walk on paper
    (each gather is freed); it is refused by its length, before the ranks run it."""
    _, sol = mutant("08")

    def zero3_actions(units, prefetch):
        return [("gather", 0), ("free", 0)] * 20_000 + sol.zero3_actions(units, prefetch)

    text = only_failure("08", zero3_actions=zero3_actions)
    assert text.startswith("zero3_actions(1, False) returned 40008 actions; ZeRO-3 needs 8 "
                           "per unit")


# ------------------------------------------------------------------ 09 ZeRO-2 in backward
def _zero2_backward(**methods):
    _, sol = mutant("09")
    return type("Mutant", (sol.Zero2Gradients,), methods)


def _reduce_bucket(op="avg", release=True, accumulate=True):
    def reduce_bucket(self, b):
        flat = self.flatten(b, [p.grad for p in self.buckets[b]])
        piece = dist.reduce_scatter(flat, op=op, group=self.group)
        for p in self.buckets[b]:
            if release:
                p.release_grad()
            else:
                p.grad = None  # gone from the parameter, not from the ledger
        if self.grad_shards[b] is None or not accumulate:
            if self.grad_shards[b] is not None:
                dist.release(self.grad_shards[b])
            self.grad_shards[b] = dist.hold(piece, "grads")
        else:
            self.grad_shards[b] += piece
    return reduce_bucket


def test_09_reducing_after_backward_has_zero1s_gradient_peak():
    def on_gradient_ready(self, b):  # waits for the whole gradient, then reduces it all
        self.ready[b] += 1
        if sum(self.ready) == sum(len(bucket) for bucket in self.buckets):
            self.ready = [0] * len(self.buckets)
            for bucket in range(len(self.buckets)):
                self.reduce_bucket(bucket)

    text = only_failure("09", Zero2Gradients=_zero2_backward(
        on_gradient_ready=on_gradient_ready))
    assert "N=2, A=1, rank 0: the ledger's gradient peak is 1344 bytes" in text
    assert "That is the whole gradient, Ψ = 168 elements" in text
    assert "reducing after backward is ZeRO-1's gradient peak" in text


def test_09_assigning_the_piece_keeps_only_the_last_micro_batch():
    text = only_failure("09", Zero2Gradients=_zero2_backward(
        reduce_bucket=_reduce_bucket(accumulate=False)))
    assert text.startswith("N=2, A=2, rank 0, step 0, bucket 0")
    assert "is only one micro-batch's piece kept?" in text and "(+=)" in text


def test_09_dropping_p_grad_without_releasing_it_is_named():
    detail = failures("09", Zero2Gradients=_zero2_backward(
        reduce_bucket=_reduce_bucket(release=False)))
    assert set(detail) == {
        "gradient PEAK <= the shards + one bucket's full gradients (the ledger)",
        "after backward: no p.grad left, only the shards in the ledger"}
    left = detail["after backward: no p.grad left, only the shards in the ledger"]
    assert "p.grad = None does not take a gradient out of the ledger" in left


def test_09_summing_over_the_ranks_is_named():
    text = only_failure("09", Zero2Gradients=_zero2_backward(
        reduce_bucket=_reduce_bucket(op="sum")))
    assert "it is N = 2 times that: summed over the ranks" in text


# ------------------------------------------------------------------ 10 sequence parallel
def _sp_mlp(gather=None, scatter=None, bias_before=False):
    """The solution's block with g (gather) and g-bar (scatter) replaced; bias_before adds
    b2 before g-bar."""
    _, sol = mutant("10")
    gather = gather or sol.GatherFromSequenceParallelRegion
    scatter = scatter or sol.ReduceScatterToSequenceParallelRegion

    def sequence_parallel_mlp(x, ln_weight, ln_bias, w1, b1, w2, b2, group):
        h = gather.apply(F.layer_norm(x, ln_weight, ln_bias), group)
        h = F.gelu(F.linear(h, w1, b1))
        if bias_before:
            return x + scatter.apply(F.linear(h, w2, b2), group)
        return x + scatter.apply(F.linear(h, w2), group) + b2
    return {"GatherFromSequenceParallelRegion": gather,
            "ReduceScatterToSequenceParallelRegion": scatter,
            "sequence_parallel_mlp": sequence_parallel_mlp}


class _AllReduce(Function):
    """TP's g (all-reduce forward, identity backward) where g-bar belongs."""

    @staticmethod
    def forward(ctx, x, group):
        return dist.all_reduce(x, group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _LocalBackward(Function):
    """An all-gather whose backward keeps my tokens' slice: no sum over the ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[1]
        return dist.all_gather(x, group=group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].copy(), None


def test_10_all_reduce_after_the_row_parallel_layer_is_tps_g_not_g_bar():
    detail = failures("10", **_sp_mlp(scatter=_AllReduce))
    assert "an all-reduce is TP's g: here each rank keeps only its tokens" in \
        detail["g-bar: reduce-scatter along the sequence forward, all-gather backward"]
    assert "operands could not be broadcast together with shapes (2,4,8) (2,8,8)" in \
        detail["your code raised ValueError (while checking: the MLP block runs on t = 2 "
               "and 4 ranks)"]  # x + h: my piece plus every token


def test_10_a_gather_whose_backward_keeps_only_my_piece_is_named():
    detail = failures("10", **_sp_mlp(gather=_LocalBackward))
    gather = detail["g: all-gather along the sequence forward, reduce-scatter backward "
                    "(t = 2, 4)"]
    assert "it kept only this rank's own gradient, with no communication" in gather
    assert "t=2, rank 0: the gradient of x differs from one device's" in \
        detail["gradients: x piece, w1/b1/w2 shards, replicated ln_weight, ln_bias, b2"]
    assert "backward called ['all_gather']" in \
        detail["communication: all-gather + reduce-scatter each way (TP's bytes), then "
               "all-reduce of the replicated gradients"]


def test_10_replicated_gradients_left_partial_are_named():
    detail = failures("10", allreduce_sequence_parallel_grads=lambda params, group: None)
    text = detail["gradients: x piece, w1/b1/w2 shards, replicated ln_weight, ln_bias, b2"]
    assert "t=2, rank 0: the gradient of ln_weight holds only this rank's tokens' share" \
        in text
    assert "Megatron's param.sequence_parallel" in text
    assert "allreduce_sequence_parallel_grads called nothing" in "".join(detail.values())


def test_10_the_bias_added_before_the_reduce_scatter_is_named():
    detail = failures("10", **_sp_mlp(bias_before=True))
    assert "off by (t - 1) x b2: b2 was added on every rank before the reduce-scatter" in \
        detail["output: my (B, T/t, d) piece of one device's x + MLP(LN(x))"]
    assert "the gradient of b2 differs" in \
        detail["gradients: x piece, w1/b1/w2 shards, replicated ln_weight, ln_bias, b2"]


# ------------------------------------------------------------------ 11 activations
def _layer_without(*, probabilities=True, sequence_parallel=True):
    _, sol = mutant("11")

    def layer_activation_bytes(config):
        nbytes = sol.layer_activation_bytes(config)
        if not probabilities:
            nbytes -= (config.micro_batch_size * config.n_head // config.tp
                       * config.seq_len ** 2 * sol.BYTES[config.precision])
        if not sequence_parallel and config.sequence_parallel:
            tokens = config.micro_batch_size * config.seq_len
            nbytes += (4 * (tokens - tokens // config.tp) * config.d_model
                       * sol.BYTES[config.precision])
        return nbytes
    return layer_activation_bytes


def test_11_forgetting_the_attention_probabilities_is_named():
    detail = failures("11", layer_activation_bytes=_layer_without(probabilities=False))
    text = "".join(detail.values())
    assert "missing the attention probabilities, B (a/t) T T?" in text


def test_11_sequence_parallelism_not_applied_to_the_stream_is_named():
    detail = failures("11", layer_activation_bytes=_layer_without(sequence_parallel=False))
    layer = next(v for k, v in detail.items() if k.startswith("one layer's saved bytes"))
    assert layer.startswith("tp=2 sp, fp32")
    assert "the stream's four tensors hold T/t tokens" in layer


def test_11_the_first_pipeline_stage_holding_one_micro_batch_is_the_interview_trap():
    _, sol = mutant("11")

    def activation_peak(config, rank, terms):  # "PP divides the activations by p"
        if config.pp == 1:
            return sol.activation_peak(config, rank, terms)
        one = config.replace(pp=1, n_layer=config.n_layer // config.pp)
        stage = (rank // config.tp) % config.pp
        embedding = terms.embedding if stage == 0 else 0
        head = terms.head if stage == config.pp - 1 else 0
        layer = sol.layer_activation_bytes(one) + terms.norm_statistics
        return one.n_layer * layer + embedding + head

    text = only_failure("11", activation_peak=activation_peak)
    assert "pp=2 m=4, fp32" in text and "rank 0: predicted" in text
    assert "counted one micro-batch: 1F1B's first stage holds p of them" in text
    assert "PP does not cut the first stage's activations" in text


def test_11_recomputation_keeping_every_layer_is_named():
    _, sol = mutant("11")

    def activation_peak(config, rank, terms):
        return sol.activation_peak(config.replace(recompute_granularity=None), rank, terms)

    text = only_failure("11", activation_peak=activation_peak)
    assert "recompute full" in text
    assert "a layer keeps only its input until its backward recomputes it" in text


@pytest.mark.parametrize("answer", [float, lambda n: np.array([], dtype=np.int64)],
                         ids=["float", "empty array"])
def test_11_a_peak_that_is_not_a_count_of_bytes_is_named(answer):
    """A float equal to the bytes, or an empty array (which NumPy before 2.2 compares as
    false, so `peak != measured` would pass it), is not an answer."""
    _, sol = mutant("11")

    def activation_peak(config, rank, terms):
        return answer(sol.activation_peak(config, rank, terms))

    text = only_failure("11", activation_peak=activation_peak)
    assert text.startswith("activation_peak returned ")
    assert "; return an int (bytes)" in text


def test_11_a_count_of_bytes_too_large_to_print_is_named():
    """10**5000 bytes once ended in Python's 4300-digit limit on printing an int."""
    _, sol = mutant("11")
    text = only_failure("11", activation_peak=lambda config, rank, terms: -10 ** 5000)
    assert text == ("activation_peak returned an integer of 16610 bits; a count of bytes "
                    "is from 0 to 2^63 - 1")


def test_11_numpy_integers_are_counts_of_bytes():
    _, sol = mutant("11")
    exercise, impl = mutant(
        "11", layer_activation_bytes=lambda c: np.int64(sol.layer_activation_bytes(c)),
        activation_peak=lambda c, r, t: np.int64(sol.activation_peak(c, r, t)))
    assert exercise.check(impl).passed


# ------------------------------------------------------------------ 12 port a recipe
def _port(change):
    _, sol = mutant("12")
    return lambda recipe, n, limit: change(sol.port_recipe(recipe, n, limit), recipe, n, limit)


def test_12_scaling_the_learning_rate_by_the_gpu_count_is_named():
    text = only_failure("12", port_recipe=_port(
        lambda port, recipe, n, limit: port.replace(lr=port.lr * n, min_lr=port.min_lr * n)))
    assert text.startswith("G = 2 x 4 = 8 on 1 GPU -> 4 GPUs (micro-batch <= 2): lr = 0.008")
    assert "the linear scaling rule follows the global batch, not the GPU count" in text


def test_12_keeping_the_one_gpu_accumulation_is_named():
    text = only_failure("12", port_recipe=lambda recipe, n, limit: recipe.replace(dp=n))
    assert "global batch 4 x 2 x 4 = 32; expected 8 (G is kept" in text
    assert "the one-GPU micro-batch and accumulation were kept" in text


def test_12_a_micro_batch_over_the_limit_is_named():
    text = only_failure("12", port_recipe=_port(
        lambda port, recipe, n, limit: port.replace(
            micro_batch_size=port.micro_batch_size * port.grad_accum_steps,
            grad_accum_steps=1)))
    assert "(micro-batch <= 2): micro_batch_size = 4 does not fit" in text


def test_12_the_grown_batch_with_the_same_steps_is_named():
    def same_steps(port, recipe, n, limit):
        return port.replace(steps=recipe.steps, warmup_steps=recipe.warmup_steps)

    text = only_failure("12", port_recipe=_port(same_steps))
    assert text.startswith("G = 3 x 2 = 6 on 1 GPU -> 4 GPUs")
    assert "steps = 8, expected 6: with k = 1.33333 times the sequences per step" in text


def test_12_the_linear_rule_for_adamw_is_named():
    def linear(port, recipe, n, limit):
        k = port.global_batch_size / recipe.global_batch_size
        return port.replace(lr=recipe.lr * k, min_lr=recipe.min_lr * k)

    text = only_failure("12", port_recipe=_port(linear))
    assert "scaled linearly by k = 1.33333; for AdamW take the square-root rule" in text


def test_12_a_port_that_changes_the_model_or_the_seed_is_named():
    """Where G grows the loss curves are not compared, so only this check stops a port of
    another model (which the checker would otherwise train, slowly)."""
    def other_model(port, recipe, n, limit):
        if port.global_batch_size == recipe.global_batch_size:
            return port
        return port.replace(seed=recipe.seed + 1, d_model=32)

    text = only_failure("12", port_recipe=_port(other_model))
    assert text.startswith("G = 3 x 2 = 6 on 1 GPU -> 4 GPUs (micro-batch <= 2): the port "
                           "changes d_model 16 -> 32, seed 0 -> 1; a port sets only dp,")
    assert "the model, the data, the seed and everything else stay the recipe's" in text


def test_12_a_port_set_around_the_configs_checks_is_refused_by_minipar():
    def around(port, recipe, n, limit):
        object.__setattr__(port, "dp", -1)  # frozen, but not to object.__setattr__
        return port

    text = only_failure("12", port_recipe=_port(around))
    assert text == ("G = 2 x 4 = 8 on 1 GPU -> 4 GPUs (micro-batch <= 2): minipar refuses "
                    "the port: ConfigError: --dp: must be a positive integer, got -1")


# ------------------------------------------------------------------ 13 choose a layout
def _layout(model, **changes):
    """choose_layout answering `model`'s task with `changes` to the solution's answer."""
    _, sol = mutant("13")

    def choose_layout(task):
        answer = sol.choose_layout(task)
        return {**answer, **changes} if task["model"] == model else answer
    return choose_layout


def test_13_tensor_parallelism_that_does_not_split_the_heads_is_refused():
    text = only_failure("13", choose_layout=_layout("gpt2-xl", dp=4, tp=2))
    assert "gpt2-xl on 8 GPUs: the layout is not valid" in text
    assert "n_head=25 is not divisible by tp=2" in text


def test_13_tensor_parallelism_across_nodes_is_named():
    text = only_failure("13", choose_layout=_layout("llama2-70b", dp=4, tp=16, pp=1))
    assert "tp=16 crosses nodes of 8 GPUs" in text and "keep tp within a node" in text


def test_13_a_layout_that_does_not_fit_names_its_largest_part():
    detail = failures("13", choose_layout=_layout("llama2-70b", dp=64, tp=1, pp=1,
                                                    sequence_parallel=False))
    text = detail["fits the GPU's usable memory (the planner's estimate)"]
    assert "llama2-70b on 64 GPUs (dp=64 tp=1 pp=1 zero=1 micro=1): the fullest GPU needs" \
        in text
    # fp32 gradient buffers (Megatron-LM's main_grad, the planner's default) are twice
    # the bf16 parameters: the largest part of an unsplit, unsharded 70B model
    assert "the largest part is grads: shard them (ZeRO-2) or split the model (tp, pp)" in text


def test_13_a_wrong_bottleneck_is_compared_with_the_planners_breakdown():
    text = only_failure("13", choose_layout=_layout("gpt2-xl", bottleneck="pipeline bubble"))
    assert "you name 'pipeline bubble' the bottleneck" in text
    assert "so it is compute-bound (no overhead reaches 10%)" in text


def test_13_a_memory_claim_far_from_the_planner_is_named():
    text = only_failure("13", choose_layout=_layout("llama2-70b", memory_gib=35.0))
    predicted = re.search(r"memory_gib = 35\.0; the planner predicts ([\d.]+) GiB", text)
    assert predicted and float(predicted.group(1)) > 35.0 / 0.85, text


def test_13_zero2_with_a_pipeline_is_refused_by_the_emulator():
    detail = failures("13", choose_layout=_layout("llama2-70b", zero=2, memory_gib=67.0))
    text = detail["the emulator trains the layout scaled down, like one device"]
    assert "minipar refuses the layout" in text and "DeepSpeed refuses" in text


def test_13_a_justification_silent_about_a_parallelism_is_named():
    why = ("Tensor parallelism tp 2 inside each node with sequence parallelism, data "
           "parallelism dp 4 with ZeRO-1 for the optimizer state; micro-batch 1.")
    text = only_failure("13", choose_layout=_layout("llama2-70b", why=why))
    assert "'why' does not say why you use pp" in text


def test_13_sizes_out_of_range_are_named_before_anything_computes_with_them():
    """dp = 10**5000 once reached the float formatting of an error message: OverflowError."""
    text = only_failure("13", choose_layout=_layout("gpt2-xl", dp=10 ** 5000, zero=4))
    assert text == "gpt2-xl on 8 GPUs: give dp from 1 to 8, zero from 0 to 3 (integers)"


def test_13_a_layout_of_another_gpu_count_is_named_first():
    text = only_failure("13", choose_layout=_layout("gpt2-xl", dp=4))
    assert text == "gpt2-xl on 8 GPUs: dp x tp x pp = 4; use all 8 GPUs"
