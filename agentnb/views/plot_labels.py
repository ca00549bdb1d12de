"""Where the usage plot's call labels go (``plot_usage``, ``views/plots.py``).

Each label (an action fired, a transition, a compaction, a loop, an action a what-if would fire) is an
annotation of a marker, offset from it in points.  :func:`fit_labels` puts each inside the ratio panel, clear
of the other labels and of the markers, or hides it where the panel has no room (no label rather than labels
written over each other).

Labels of one call whose markers are near each other (the action the record fired and the one a what-if
would fire, often at the same ratio; several jobs' in a frame) are placed together as a *stack*: one column
on one side of the markers, in the order of their markers (the highest marker's label on the outside), each
with a leader line to its own marker, so that any number of them reads as a list and none can land on
another.  A stack that has no room anywhere falls back to placing its labels one by one.

The places are found on the figure's layout, and the layout is then fixed (the figure's layout engine set to
``"none"``): constrained layout does not always settle in one pass (a legend taller than the ratio panel
moves the axes again at every draw), and a later draw that moved the axes would have moved the markers from
under labels placed for the earlier layout, writing labels of nearby calls over each other.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axes._secondary_axes import SecondaryAxis
    from matplotlib.figure import Figure
    from matplotlib.text import Annotation
    from matplotlib.transforms import Bbox

__all__ = ["NEAR", "PLACES", "STACK_GAP", "fit_labels", "lay_out", "leader"]

# Where a call's label may go, in points from its marker, best first: beside the marker, then further
# up or down (with a leader line).  Left of the marker only when right of it is taken or outside the axes.
NEAR = 7
PLACES = [(dx, dy) for dy in (NEAR, -NEAR, 20, -20, 33, -33, 46, -46, 59, -59, 72, -72) for dx in (NEAR, -NEAR)]
# points between two stacked labels' texts: each box's pad (0.2 of the font size) and edge stay apart
STACK_GAP = 6.0
# labels stack when their markers are at one call and at most this many points apart (about a label's height
# and a gap: placed alone at the same offset, the two would meet); further apart, each has room by its marker
_STACK_REACH = 20.0
# the labels that go above their marker first, and below (a transition's: an action fired at the same call
# goes above)
_ABOVE = ("label:action", "label:what_if", "label:compaction")
_BELOW = ("label:transition",)


def leader(colour: str) -> dict[str, Any]:
    """The arrowprops of a label's leader line (drawn only when the label had to move away from its marker)."""
    return {"arrowstyle": "-", "color": colour, "linewidth": 0.8, "alpha": 0.8, "shrinkA": 0, "shrinkB": 5}


def lay_out(fig: Figure) -> None:
    with warnings.catch_warnings():
        # a glyph missing from every font is reported when the figure is shown; once is enough
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")
        fig.draw_without_rendering()


def fit_labels(fig: Figure, ax: Axes, labels: list[Annotation], runs_axis: SecondaryAxis | None,
               points: Any = None) -> None:
    """Tilt run names that would overlap; put each call label inside the axes, clear of the other labels
    and of the markers (``points``, in data coordinates), stacking the labels of one call; then fix the
    layout, so the places found are the ones drawn at any later draw (offsets are in points, so they hold at
    any dpi)."""
    from matplotlib.text import Text

    for t in labels:  # placed inside the axes below: they need not take part in the layout (slow with many)
        t.set_in_layout(False)
    lay_out(fig)
    if runs_axis is not None:
        _tilt_run_names(fig, runs_axis)
    inside = ax.get_window_extent()
    pt = fig.dpi / 72
    # every marker, as a small square no label may cover (numpy: a job may have thousands of calls)
    marks = ax.transData.transform(points) if points is not None and len(points) else np.empty((0, 2))
    boxes: list[Bbox] = []

    def free(box: Bbox) -> bool:
        near = 4 * pt
        hit = ((marks[:, 0] + near > box.x0) & (marks[:, 0] - near < box.x1)
               & (marks[:, 1] + near > box.y0) & (marks[:, 1] - near < box.y1))
        return not hit.any() and not any(box.overlaps(other) for other in boxes)

    def within(box: Bbox) -> bool:
        return inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1

    def put(t: Annotation, dx: float, dy: float) -> Bbox:
        t.xyann = (dx, dy)
        t.set_horizontalalignment("left" if dx > 0 else "right")
        t.set_verticalalignment("bottom" if dy > 0 else "top")
        if t.arrow_patch is not None:  # a leader line only when the label had to move away
            t.arrow_patch.set_visible(abs(dy) > NEAR)
        # the text alone: an Annotation's own extent includes its leader line, which ends at the marker
        return Text.get_window_extent(t).padded(1.5 * pt)

    def places(t: Annotation) -> list[tuple[int, int]]:
        return PLACES if t.get_gid() not in _BELOW else [(dx, -dy) for dx, dy in PLACES]

    def place_one(t: Annotation) -> None:
        first_inside = None
        for dx, dy in places(t):
            box = put(t, dx, dy)
            if not within(box):
                continue
            first_inside = first_inside or (dx, dy)
            if free(box):
                boxes.append(box)
                return
        # nowhere free (a crowded plot): no label rather than labels written over each other
        put(t, *(first_inside or PLACES[0]))
        t.set_visible(False)

    def place_stack(stack: list[Annotation]) -> bool:
        """The labels of ``stack`` in one column at the first place where all fit; False when none has room."""
        anchors = [float(y) for _, y in (ax.transData.transform(t.xy) for t in stack)]
        for dx, dy in places(stack[0]):
            up = dy > 0
            # the highest marker's label outermost, so the leader lines do not cross
            order = sorted(range(len(stack)), key=lambda i: anchors[i], reverse=not up)
            # the column starts past every marker of the stack: above the highest, or below the lowest
            edge = (max(anchors) if up else min(anchors)) + dy * pt
            found: list[Bbox] = []
            for i in order:
                t = stack[i]
                asked = (edge - anchors[i]) / pt
                box = put(t, dx, asked)
                # the text's edge lands where asked up to its layout's rounding: moved by what is left over
                landed = box.y0 + 1.5 * pt if up else box.y1 - 1.5 * pt
                if abs(landed - edge) > 0.5:
                    box = put(t, dx, asked - (landed - edge) / pt)
                if not (within(box) and free(box) and not any(box.overlaps(b) for b in found)):
                    break
                found.append(box)
                edge = (box.y1 + (STACK_GAP - 1.5) * pt) if up else (box.y0 - (STACK_GAP - 1.5) * pt)
            else:
                boxes.extend(found)
                return True
        return False

    for group in _stacks(ax, labels, _STACK_REACH * pt):
        if len(group) == 1 or not place_stack(group):
            for t in group:
                place_one(t)
    # fixed from here on: a later draw must not move the markers from under the labels (see the docstring)
    fig.set_layout_engine("none")


def _stacks(ax: Axes, labels: Sequence[Annotation], reach: float) -> list[list[Annotation]]:
    """``labels`` in groups to place together, in the order of their first label: those of one call that go
    the same way (above or below their markers) and whose markers are within ``reach`` pixels, transitively;
    every other label alone."""
    keyed: dict[tuple[float, bool], list[Annotation]] = {}
    for t in labels:
        gid = t.get_gid()
        if gid in _ABOVE or gid in _BELOW:
            keyed.setdefault((float(t.xy[0]), gid in _BELOW), []).append(t)
    group_of: dict[int, list[Annotation]] = {}
    for same_call in keyed.values():
        ys = {id(t): float(ax.transData.transform(t.xy)[1]) for t in same_call}
        run: list[Annotation] = []
        for t in sorted(same_call, key=lambda t: ys[id(t)]):
            if run and ys[id(t)] - ys[id(run[-1])] > reach:
                run = []
            run.append(t)
            group_of[id(t)] = run
    made = {id(t): i for i, t in enumerate(labels)}
    groups: list[list[Annotation]] = []
    seen: set[int] = set()
    for t in labels:
        if id(t) in seen:
            continue
        group = group_of.get(id(t), [t])
        seen.update(id(g) for g in group)
        groups.append(sorted(group, key=lambda g: made[id(g)]))  # as made: the record's before a what-if's
    return groups


def _tilt_run_names(fig: Figure, runs_axis: SecondaryAxis) -> None:
    """The runs' names along the top, tilted when they would overlap (every k-th when even that is too many)."""
    names = [n for n in runs_axis.get_xticklabels() if n.get_text()]
    spans = [n.get_window_extent() for n in names]
    if not any(a.x1 + 4 > b.x0 for a, b in pairwise(spans)):
        return
    # Tilted, parallel names clear each other when their anchors are 2 line heights apart; with more runs
    # than that allows, every k-th is named (the boundaries and colours still show each run).
    height = max(b.height for b in spans)
    step = min((b.x0 + b.x1) / 2 - (a.x0 + a.x1) / 2 for a, b in pairwise(spans))
    k = max(1, math.ceil(2.2 * height / max(step, 1e-9)))
    runs_axis.tick_params(labelrotation=30)
    for i, n in enumerate(names):
        n.set_horizontalalignment("left")
        n.set_rotation_mode("anchor")
        n.set_visible(i % k == 0)
    lay_out(fig)
