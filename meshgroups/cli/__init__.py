"""``python -m meshgroups``: the command line (``app.py``: the parser and ``main``; one module
per subcommand family: ``elastic.py``, ``transfer.py``; ``demo.py``: the demo job; ``args.py``:
strict command-line values)::

    >>> from meshgroups.cli import main
    >>> main(["show", "dp=2", "tp=2", "--json"]) == 0  # doctest: +SKIP
    True
"""

from __future__ import annotations

from meshgroups.cli.app import main

__all__ = ["main"]
