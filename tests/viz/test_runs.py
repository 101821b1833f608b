"""The runs behind the explorers: a cache that computes each key once, and one measured
pipeline step whose bubble and activations follow the schedules' definitions."""

from __future__ import annotations

import pytest

from minipar.viz.runs import RunCache, pipeline_step


def test_run_cache_computes_each_key_once():
    cache, calls = RunCache(), []

    def compute():
        calls.append(1)
        return len(calls)

    assert cache.get("a", compute) == 1
    assert cache.get("a", compute) == 1
    assert cache.get("b", compute) == 2
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 2)
    cache.clear()
    assert cache.get("a", compute) == 3


def test_a_failing_run_is_not_cached():
    cache = RunCache()

    def fail():
        raise ValueError("no")

    for _ in range(2):
        with pytest.raises(ValueError):
            cache.get("x", fail)
    assert len(cache) == 0 and cache.misses == 2


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_pipeline_step_bubble_is_the_uniform_formula_plus_the_head(p, m):
    gpipe, one_f = (pipeline_step(name, p, m) for name in ("gpipe", "1f1b"))
    formula = (p - 1) / (m + p - 1)  # Narayanan et al. 2021, section 2.2
    for run in (gpipe, one_f):
        assert run["formula"] == pytest.approx(formula)
        # the last stage also runs the LM head and the loss: a little more, never less
        assert formula <= run["bubble"] <= formula + 0.05
        assert len(run["timelines"]) == p
    # same micro-batches, same weights: the schedule changes the order, not the loss
    assert gpipe["loss"] == one_f["loss"]
    assert gpipe["in_flight"] == [m] * p
    assert one_f["in_flight"] == [min(p - s, m) for s in range(p)]


def test_interleaving_shrinks_the_bubble_by_the_number_of_chunks():
    run = pipeline_step("interleaved", 4, 8, 2)
    formula = 3 / (2 * 8 + 3)  # (p-1)/(v m + p-1)
    assert run["formula"] == pytest.approx(formula)
    assert formula <= run["bubble"] <= formula + 0.05
