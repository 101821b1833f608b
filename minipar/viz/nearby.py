"""The settings one control change away from the one shown: what the explorers' worker
prepares while the reader looks (minipar/viz/explorer.py, minipar/viz/prefetch.py).

    neighbours(controls, {"dp": 2, "zero": 1}, option_reach=3)   # nearest options first
    ahead(controls, {"zero": 0}, {"zero": 1})                     # -> {"zero": 2}

`controls` maps a name to its ipywidgets control: a drop-down (it has options) moves to
another of its options, a check box (a bool value) toggles, a slider moves to another
value between its min and max. (Told apart by what they have, so this module needs no
ipywidgets of its own: the explorers import it and say what to install when it is missing.)
"""

from __future__ import annotations


def _kind(control) -> str:
    if hasattr(control, "_options_values"):
        return "dropdown"
    return "check" if isinstance(control.value, bool) else "slider"


def neighbours(controls: dict, values: dict, option_reach: int,
               slider_reach: int | None = None) -> list[dict]:
    """The settings one control change away, nearest options first: every control's
    adjacent option, then the options two away, and so on up to `option_reach` (a
    slider: `slider_reach` steps either side, None for its whole range; a check box:
    toggled)."""
    rings: list[list[dict]] = []
    for name, control in controls.items():
        value = values[name]
        kind = _kind(control)
        if kind == "check":
            ordered = [[not value]]
        elif kind == "slider":
            reach = slider_reach or control.max - control.min
            ordered = [[v for v in (value - d, value + d) if control.min <= v <= control.max]
                       for d in range(1, reach + 1)]
        else:
            options = list(control._options_values)  # the values behind the labels
            here = options.index(value)
            ordered = [[options[i] for i in (here - d, here + d) if 0 <= i < len(options)]
                       for d in range(1, min(len(options), option_reach + 1))]
        for distance, near in enumerate(ordered):
            while len(rings) <= distance:
                rings.append([])
            rings[distance] += [{**values, name: v} for v in near]
    return [setting for ring in rings for setting in ring]


def changed(previous: dict | None, values: dict) -> list[str]:
    """The controls whose value differs between two settings (none without a previous)."""
    if previous is None:
        return []
    return [name for name in values if previous.get(name) != values[name]]


def ahead(controls: dict, previous: dict | None, values: dict) -> dict | None:
    """One more step along the last change, if it moved one drop-down or slider
    (ZeRO 1 -> 2 after 0 -> 1; m 12 after 8 -> 10): a reader who sweeps a control, as
    the notebooks suggest ("try ZeRO 0 to 3"), asks for it next. None otherwise."""
    moved = changed(previous, values)
    if len(moved) != 1 or _kind(controls[moved[0]]) == "check":
        return None
    name = moved[0]
    control = controls[name]
    if _kind(control) == "slider":
        value = 2 * values[name] - previous[name]  # the same stride again
        return {**values, name: value} if control.min <= value <= control.max else None
    options = list(control._options_values)
    if previous[name] not in options:
        return None
    here, before = options.index(values[name]), options.index(previous[name])
    further = here + (1 if here > before else -1)
    return {**values, name: options[further]} if 0 <= further < len(options) else None
