"""Moved to :mod:`meshgroups.mesh.collective`; this import path keeps working (it was shown in the docs)."""

from meshgroups.mesh.collective import *  # noqa: F403
from meshgroups.mesh.collective import __all__ as __all__
