"""The explorers' controls: how one is made, and how a setting is given to them by name.

    controls = {"dp": make_control("dropdown", "dp", [1, 2, 4], 2, "110px")}
    assign("MyExplorer", controls, {"dp": 4})    # a clear error for a name or value it lacks

ipywidgets does the rest: a control's `.value` is its setting, and `observe` tells the
explorer (minipar/viz/explorer.py) when the reader changes it.
"""

from __future__ import annotations

import re

from minipar.errors import flag
from minipar.viz.nearby import changed

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


def the_change(controls: dict, before: dict | None, values: dict) -> str:
    """' with "dp" = 4' when one control moved from `before` to `values`, else '': a
    refusal names the change it answers, so that a second refusal with the same reason
    (another control changed, the culprit still set) reads as an answer."""
    moved = changed(before, values)
    return (f' with "{controls[moved[0]].description}" = {values[moved[0]]}'
            if len(moved) == 1 else "")
