"""Moved to :mod:`meshgroups.elastic.heal`; this import path keeps working (it was shown in the docs)."""

from meshgroups.elastic.heal import *  # noqa: F403
from meshgroups.elastic.heal import __all__ as __all__
