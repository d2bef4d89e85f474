"""Moved to :mod:`meshgroups.layout.checks`; this import path keeps working (it was shown in the docs)."""

from meshgroups.layout.checks import *  # noqa: F403
from meshgroups.layout.checks import __all__ as __all__
