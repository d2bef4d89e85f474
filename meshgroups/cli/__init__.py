"""``python -m meshgroups``: the command line (``_app``: the parser and ``main``; one private module
per subcommand family: ``_elastic``, ``_transfer``, ``_cost``; ``_demo``: the demo job; ``_args``:
strict command-line values)::

    >>> from meshgroups.cli import main
    >>> main(["show", "dp=2", "tp=2", "--json"])  # doctest: +ELLIPSIS
    {
     "fingerprint": "85aae5a49ae509a5",
    ...
    0
"""

from __future__ import annotations

from meshgroups.cli._app import main
from meshgroups.cli._demo import run_checks

__all__ = ["main"]

# Not in __all__: the demo's per-rank checks, for tools/gpu_check.py.
