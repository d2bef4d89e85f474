"""Moved to :mod:`meshgroups.cli.demo`; this import path keeps working (it was shown in the docs)."""

from meshgroups.cli.demo import *  # noqa: F403
from meshgroups.cli.demo import __all__ as __all__
