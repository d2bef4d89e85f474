"""Moved to :mod:`meshgroups.render.widgets`; this import path keeps working (it was shown in the docs)."""

from meshgroups.render.widgets import *  # noqa: F403
from meshgroups.render.widgets import __all__ as __all__
