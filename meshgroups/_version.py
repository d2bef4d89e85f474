"""meshgroups' version, in one place: ``pyproject.toml`` reads it (``dynamic = ["version"]``)."""

__version__ = "0.5.0"
