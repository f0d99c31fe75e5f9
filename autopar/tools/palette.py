"""One colour per placement, the same in every picture of a plan: the HTML report
(autopar/tools/report.py) and the matplotlib figures (autopar/tools/visualize.py) both
colour a tensor by `placement_colour(str(spec))`.

The colour depends on the placement string alone, never on which other placements a plan
holds, so `S(0)R` is the same blue in every figure of every plan:

    all R (any mesh)     grey
    S(0)R / S(0)         blue        RS(0)  light blue
    S(1)R / S(1)         orange      RS(1)  light orange
    S(2)R / S(2)         green       RS(2)  light green
    PR / P               red         RP     light red
    two split axes       a colour of their own (S(0)S(1) teal, S(2)S(1) brown, ...)
    anything else        a hue from the string's MD5 (deterministic across runs)

A shard's unit and a partial's reduction do not change the colour: `S(0/64)R` is `S(0)R`'s,
`P(avg)R` is `PR`'s.
"""

from __future__ import annotations

import colorsys
import hashlib
import re

REPLICATED = "#bdbdbd"
# placement string (units and reductions dropped) -> colour; a one-axis mesh's placement
# shares the colour of the same placement on a two-axis mesh's first axis
_FIXED = {
    "S(0)R": "#1f77b4", "RS(0)": "#8fbfe0", "S(1)R": "#ff7f0e", "RS(1)": "#ffbb78",
    "S(2)R": "#2ca02c", "RS(2)": "#98df8a", "S(3)R": "#9467bd", "RS(3)": "#c5b0d5",
    "PR": "#d62728", "RP": "#ff9896",
    "S(0)S(1)": "#17becf", "S(1)S(0)": "#bcbd22", "S(0)S(0)": "#0b4f8a", "S(1)S(1)": "#a34a00",
    "S(2)S(1)": "#8c564b", "S(1)S(2)": "#e377c2", "S(0)S(2)": "#1b7837", "S(2)S(0)": "#7b7d00",
    "S(2)S(2)": "#1a5e1a", "S(3)S(1)": "#6a3d9a", "S(0)S(3)": "#5e3c99",
    "PS(0)": "#7f2704", "PS(1)": "#e7298a", "PS(2)": "#a6761d", "S(0)P": "#4a1486",
    "S(1)P": "#c51b7d", "S(2)P": "#66a61e", "PP": "#67000d",
}
_FIXED.update({k[:-1]: v for k, v in list(_FIXED.items()) if k.endswith("R") and k.count("(") == 1})  # "S(0)"
_FIXED["P"] = _FIXED["PR"]
_TOKEN = re.compile(r"S\((\d+)(?:/\d+)?\)|R|P(?:\(\w+\))?")

# the parts of a rank's memory (Plan.param_bytes, state_bytes, activation_bytes)
MEMORY_COLOURS = {"parameters": "#4c72b0", "gradients + optimizer state": "#dd8452", "activations": "#55a868"}
COMPUTE = "#4c72b0"
COMMUNICATION = "#c44e52"
CAPACITY = "#222222"


def canonical(placement: str) -> str:
    """'S(0/64)P(avg)' -> 'S(0)P': the string the colour is keyed by. A multi-output
    label ('S(0)R,RR') is keyed by its first output."""
    first = placement.split(",")[0].strip()
    return "".join("R" if t.group(0) == "R" else "P" if t.group(0).startswith("P") else f"S({t.group(1)})"
                   for t in _TOKEN.finditer(first))


def placement_colour(placement: str) -> str:
    """The '#rrggbb' colour of a placement string such as 'S(0)R' (see the table above)."""
    key = canonical(placement)
    if not key or set(key) == {"R"}:
        return REPLICATED
    if key in _FIXED:
        return _FIXED[key]
    digest = int(hashlib.md5(key.encode()).hexdigest(), 16)
    r, g, b = colorsys.hls_to_rgb((digest % 360) / 360, 0.45 + (digest >> 9) % 3 * 0.1, 0.65)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def text_colour(background: str) -> str:
    """Black or white, whichever reads better on `background` ('#rrggbb')."""
    r, g, b = (int(background[i:i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"
