"""Generalised Hilbert ("Gilbert") space-filling curve for any ``h x w`` grid.

The curve recursively splits a rectangle along its longer side (two halves when the rectangle is
much longer than wide, otherwise a U of three sub-rectangles), nudging the split so that every
sub-rectangle keeps a parity for which a path of unit steps exists. This is the construction of
J. Cerveny's ``gilbert2d``; the code here is an independent iterative rewrite.

For a rectangle whose longer side is odd and shorter side even there is no unit-step path between
the two corners of the long side (grid-graph colouring argument); in that case the curve runs
along the shorter side instead, which always admits one. With this choice every grid size gets a
path of unit steps that visits each cell once (checked exhaustively in the tests). This choice is
``orientation='adaptive'``. ``orientation='released'`` is LOOPE's released curve
(AbtahiMajeed144/LOOPE, ``models/positional_encodings/hilbert.py``, ``gilbert_2d``: it always starts the
recursion with the major axis along the width, ``generate(0, 0, width, 0, 0, height)``, whatever the
shape): identical on squares and on rectangles wider than tall with an even height or odd width, a
different (still one-visit-per-cell) order on the others, where it may take diagonal or longer steps.
"""
from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["gilbert_path", "gilbert_order", "GILBERT_ORIENTATIONS"]

#: how the curve picks its major axis (see the module docstring)
GILBERT_ORIENTATIONS: tuple[str, ...] = ("adaptive", "released")


def _sgn(v: int) -> int:
    return (v > 0) - (v < 0)


def _walk(x: int, y: int, ax: int, ay: int, bx: int, by: int, out: list[tuple[int, int]]) -> None:
    """Append the cells of the sub-rectangle at ``(x, y)`` spanned by the major vector ``(ax, ay)``
    and the minor vector ``(bx, by)``, in curve order (iterative, explicit stack)."""
    stack = [(x, y, ax, ay, bx, by)]
    while stack:
        x, y, ax, ay, bx, by = stack.pop()
        length = abs(ax + ay)
        breadth = abs(bx + by)
        dax, day = _sgn(ax), _sgn(ay)
        dbx, dby = _sgn(bx), _sgn(by)
        if breadth == 1:  # a single row along the major direction
            out.extend((x + i * dax, y + i * day) for i in range(length))
            continue
        if length == 1:  # a single column along the minor direction
            out.extend((x + i * dbx, y + i * dby) for i in range(breadth))
            continue
        ax2, ay2 = ax // 2, ay // 2
        bx2, by2 = bx // 2, by // 2
        half_len = abs(ax2 + ay2)
        half_br = abs(bx2 + by2)
        parts: list[tuple[int, int, int, int, int, int]]
        if 2 * length > 3 * breadth:
            # long and thin: two pieces side by side along the major axis
            if half_len % 2 and length > 2:
                ax2, ay2 = ax2 + dax, ay2 + day
            parts = [
                (x, y, ax2, ay2, bx, by),
                (x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by),
            ]
        else:
            # a U: up the first half of the minor axis, along the whole major axis, back down
            if half_br % 2 and breadth > 2:
                bx2, by2 = bx2 + dbx, by2 + dby
            parts = [
                (x, y, bx2, by2, ax2, ay2),
                (x + bx2, y + by2, ax, ay, bx - bx2, by - by2),
                (x + (ax - dax) + (bx2 - dbx), y + (ay - day) + (by2 - dby), -bx2, -by2, -(ax - ax2), -(ay - ay2)),
            ]
        stack.extend(reversed(parts))  # LIFO: push last part first


@lru_cache(maxsize=64)
def gilbert_path(height: int, width: int, orientation: str = "adaptive") -> tuple[tuple[int, int], ...]:
    """The cells ``(row, col)`` of an ``height x width`` grid in the order the curve visits them.

    ``orientation='adaptive'`` (default): unit steps on every grid; ``'released'``: LOOPE's released
    curve, major axis always along the width (module docstring)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"gilbert_path needs positive sizes, got {height}x{width}")
    if orientation not in GILBERT_ORIENTATIONS:
        raise ValueError(f"orientation={orientation!r} is not valid; choose one of {list(GILBERT_ORIENTATIONS)}")
    out: list[tuple[int, int]] = []  # (x=col, y=row)
    if orientation == "released":
        long_is_x = True  # released hilbert.py gilbert_2d: no branch on the shape
    else:
        long_is_x = width >= height
        if long_is_x and width % 2 and not height % 2 and height > 1:
            long_is_x = False  # odd long side with even short side: go along the short side (see module doc)
        elif not long_is_x and height % 2 and not width % 2 and width > 1:
            long_is_x = True
    if long_is_x:
        _walk(0, 0, width, 0, 0, height, out)
    else:
        _walk(0, 0, 0, height, width, 0, out)
    return tuple((y, x) for x, y in out)


def gilbert_order(
    height: int, width: int, device: torch.device | str | None = None, orientation: str = "adaptive"
) -> torch.Tensor:
    """For every cell in row-major order, its 0-based step along the curve: int64 ``(height*width,)``.

    This is the inverse permutation of :func:`gilbert_path` (the step *of* patch ``p``, not the patch
    *at* step ``p``).
    """
    path = gilbert_path(int(height), int(width), orientation)
    rows = torch.tensor([r for r, _ in path], dtype=torch.int64)
    cols = torch.tensor([c for _, c in path], dtype=torch.int64)
    order = torch.empty(height * width, dtype=torch.int64)
    order[rows * width + cols] = torch.arange(height * width, dtype=torch.int64)
    return order.to(device) if device is not None else order
