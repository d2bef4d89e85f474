"""meshgroups: distributed-training rank layouts as named n-D numpy grids.

``Layout`` (pure numpy) describes which ranks form which groups; ``init_mesh`` turns a layout
into a real ``torch.distributed`` ``DeviceMesh`` and process groups, each created once.
"""

from .layout import Layout, Locality

__all__ = ["Layout", "Locality"]
__version__ = "0.1.0"
