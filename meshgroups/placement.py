"""Moved to :mod:`meshgroups.layout.placement`; this import path keeps working (it was shown in the docs)."""

from meshgroups.layout.placement import *  # noqa: F403
from meshgroups.layout.placement import __all__ as __all__
