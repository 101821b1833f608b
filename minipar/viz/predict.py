"""Predict, then measure: how far a prediction written before an experiment was from
what the experiment measured.

    guess = 0.25                               # a cell tagged `predict`: the reader's number
    ...                                        # the experiment
    print(judge(guess, measured, "pp=4, stage 0's activations / one GPU's"))
    # pp=4, stage 0's activations / one GPU's: you predicted 0.25, measured 0.96: off,
    #   the measurement is 3.84x your figure
    print(judge_choice("a", "c", {"a": "1/4", "b": "1/2", "c": "about all of them"}))

The notebooks ask before each experiment (cells tagged `predict`, with a default the
tests run) and answer with these lines after it.
"""

from __future__ import annotations

import math


def judge(prediction, measured: float, what: str, *, close: float = 0.1,
          digits: int = 3) -> str:
    """One line comparing a numeric prediction with the measurement: within `close`
    (relative), "close" and the error; otherwise how many times the one is the other. A
    prediction of None says none was written."""
    shown = f"{measured:.{digits}g}"
    if prediction is None:
        return f"{what}: measured {shown} (write a prediction first, then run again)"
    prediction = float(prediction)
    if not math.isfinite(prediction):
        raise ValueError(f"judge: the prediction for {what!r} is {prediction}: write a number")
    head = f"{what}: you predicted {prediction:.{digits}g}, measured {shown}"
    if measured == prediction:
        return f"{head}: exactly"
    if measured == 0 or prediction == 0:
        return f"{head}: off by {abs(measured - prediction):.{digits}g}"
    error = prediction / measured - 1
    if abs(error) <= close:
        return f"{head}: close ({error:+.0%})"
    ratio = prediction / measured
    if ratio > 1:
        return f"{head}: off, your figure is {ratio:.{digits}g}x the measurement"
    return f"{head}: off, the measurement is {1 / ratio:.{digits}g}x your figure"


def judge_choice(choice, answer, options: dict, what: str = "your choice") -> str:
    """One line comparing a chosen option (a key of `options`) with the measured one."""
    if choice not in options:
        raise ValueError(f"judge_choice: {choice!r} is not one of the options "
                         f"{list(options)}: write one of them")
    measured = f"({answer}) {options[answer]}"
    if choice == answer:
        return f"{what}: you chose {measured}: right, as measured"
    return f"{what}: you chose ({choice}) {options[choice]}; measured: {measured}"
