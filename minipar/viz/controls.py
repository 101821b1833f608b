"""The explorers' controls: how one is made, and how a setting is given to them by name.

    controls = {"dp": make_control("dropdown", "dp", [1, 2, 4], 2, "110px")}
    assign("MyExplorer", controls, {"dp": 4})    # a clear error for a name or value it lacks

ipywidgets does the rest: a control's `.value` is its setting, and `observe` tells the
explorer (minipar/viz/explorer.py) when the reader changes it.
"""

from __future__ import annotations

import re

from minipar.errors import flag

try:
    import ipywidgets as widgets
except ImportError as error:  # the library itself does not need ipywidgets
    raise ImportError("minipar.viz.widgets needs ipywidgets: pip install 'minipar[notebooks]' "
                      "(or pip install 'ipywidgets>=8')") from error


def make_control(kind, description: str, options=None, value=None, width="170px"):
    """A drop-down ("dropdown", `options`), a check box ("check") or an integer slider
    ("slider", `options` = (min, max), updated when released), labelled `description`."""
    style = {"description_width": "initial"}
    layout = widgets.Layout(width=width)
    if kind == "dropdown":
        return widgets.Dropdown(options=options, value=value, description=description,
                                style=style, layout=layout)
    if kind == "check":
        return widgets.Checkbox(value=value, description=description, style=style,
                                layout=layout, indent=False)
    if kind == "slider":
        return widgets.IntSlider(value=value, min=options[0], max=options[1], style=style,
                                 description=description, layout=layout,
                                 continuous_update=False)
    raise ValueError(kind)


def assign(owner: str, controls: dict, values: dict) -> None:
    """Set controls by name, refusing an unknown name or a value a control does not offer
    with a message naming both (ipywidgets says only "Invalid selection")."""
    for name, value in values.items():
        if name not in controls:
            raise KeyError(f"{owner} has no control {name!r}; it has {', '.join(controls)}")
        control, what = controls[name], f"{owner}: {name} ({controls[name].description!r})"
        if hasattr(control, "_options_values") and value not in control._options_values:
            raise ValueError(f"{what} is one of {list(control._options_values)}, got {value!r}")
        if isinstance(control, widgets.IntSlider) and not (
                isinstance(value, int) and control.min <= value <= control.max):
            raise ValueError(f"{what} is an integer from {control.min} to {control.max}, "
                             f"got {value!r}")
        control.value = value


def in_control_words(controls: dict, aliases: dict, message: str) -> str:
    """A refusal in the words of these controls: the rules speak in command-line flags
    (`--virtual-stages 2`, shared with `minipar train`), the reader sees the controls'
    labels ("v (chunks)" = 2). A flag is a control's name with dashes, or one of `aliases`
    (flag -> control name); a value follows it if it is a number or one of the control's
    options."""
    flags = {flag(name): name for name in controls}
    flags.update(aliases)

    def word(match):
        name = flags.get(match.group(1))
        if name is None:
            return match.group(0)
        control, value = controls[name], match.group(3)
        options = ({str(v) for v in control._options_values}
                   if hasattr(control, "_options_values") else set())
        label = f'"{control.description}"'
        if value is not None and (value[0].isdigit() or value in options):
            return f"{label} = {value}"
        return label + (match.group(2) or "")

    return re.sub(r"(--[a-z][a-z-]*)( ([\w./-]+))?", word, message)


def changed(previous: dict | None, values: dict) -> list[str]:
    """The controls whose value differs between two settings (none without a previous)."""
    if previous is None:
        return []
    return [name for name in values if previous.get(name) != values[name]]


def distance(controls: dict, a: dict, b: dict) -> tuple[int, int]:
    """How far setting b is from a: the controls that differ, then how many options (or
    slider steps) apart they are in all; a setting's name that is no control counts 1.
    The order in which an explorer measures its lattice in the background."""
    steps = 0
    moved = changed(a, b)
    for name in moved:
        control = controls.get(name)
        options = list(control._options_values) if hasattr(control, "_options_values") else ()
        if a[name] in options and b[name] in options:
            steps += abs(options.index(a[name]) - options.index(b[name]))
        elif isinstance(a[name], int) and isinstance(b[name], int):
            steps += abs(a[name] - b[name])
        else:
            steps += 1
    return len(moved), steps


def the_change(controls: dict, before: dict | None, values: dict) -> str:
    """' with "dp" = 4' when one control moved from `before` to `values`, else '': a
    refusal names the change it answers, so that a second refusal with the same reason
    (another control changed, the culprit still set) reads as an answer."""
    moved = changed(before, values)
    return (f' with "{controls[moved[0]].description}" = {values[moved[0]]}'
            if len(moved) == 1 else "")
