"""Moved to :mod:`meshgroups.elastic.recover`; this import path keeps working (it was shown in the docs)."""

from meshgroups.elastic.recover import *  # noqa: F403
from meshgroups.elastic.recover import __all__ as __all__
