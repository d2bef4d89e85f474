"""Moved to :mod:`meshgroups.elastic.verdict`; this import path keeps working (it was shown in the docs)."""

from meshgroups.elastic.verdict import *  # noqa: F403
from meshgroups.elastic.verdict import __all__ as __all__
