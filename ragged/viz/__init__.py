"""Pictures of layouts: where every element of a unit lives on every device, as planned (``ragged``)
or under FSDP2's per-parameter and GSPMD's per-tensor sharding, for the same tensors.

- ``draw_layout``: one unit as a ``LayoutDrawing`` (rows of ``Segment``s: plain data);
- ``draw_side_by_side``, ``draw_plan``: a ``Picture`` (SVG in Jupyter, ``Picture.svg()``; colored rows
  in a rich console) of one unit three ways, or of a whole model;
- ``METHODS``: the ways a unit can be drawn.
"""

from ragged.viz._drawing import METHODS, LayoutDrawing, Segment, draw_layout
from ragged.viz._picture import Picture, draw_plan, draw_side_by_side

__all__ = ["METHODS", "Segment", "LayoutDrawing", "draw_layout", "Picture", "draw_side_by_side", "draw_plan"]
