"""Moved to :mod:`meshgroups.mesh.cohort`; this import path keeps working (it was shown in the docs)."""

from meshgroups.mesh.cohort import *  # noqa: F403
from meshgroups.mesh.cohort import __all__ as __all__
