"""What every subcommand of ``python -m meshgroups`` shares, so the command line speaks one
dialect:

- dims are ``name=size`` words (``pp=2 dp=2 tp=4``), for one layout as positional words, for two
  (``transfer``) after ``--src`` and ``--dst``;
- one ``--node N`` option: ranks per node (consecutive ranks share a node);
- one set of model presets (:data:`meshgroups.models.PRESETS`, the cost model's);
- ``--help`` gives every option a sentence and its default;
- ``--json`` prints one JSON document (lists of numbers on one line each);
- an old spelling (``--ranks-per-node``, ``--src pp=2,tp=4``, ``--layout``, ``llama-8b``) still
  works and prints one ``warning:`` line on stderr naming the new one.

::

    >>> print(dumps({"tp": [[0, 1], [2, 3]], "size": 2}))
    {
     "tp": [
      [0, 1],
      [2, 3]
     ],
     "size": 2
    }
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from meshgroups._checks import MAX_RANK, did_you_mean
from meshgroups._deprecated import REMOVED_IN
from meshgroups.cli._args import bounded_int
from meshgroups.layout import Topology
from meshgroups.models import ALIASES, PRESETS

__all__ = [
    "HelpFormatter",
    "add_node",
    "deprecated",
    "dim_words",
    "dumps",
    "model_name",
    "node_of",
    "print_json",
    "topology_of",
]


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` with every option's default: an option whose sentence does not state its
    default gets ``(default: X)`` appended (a flag, or an option without one, gets nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and default not in (None, False, True, argparse.SUPPRESS)
            and not (isinstance(default, (list, tuple)) and not default)
        ):
            text += " (default: %(default)s)"
        return text


def deprecated(old: str, new: str) -> None:
    """One ``warning:`` line on stderr: ``old`` still works, ``new`` is the spelling to use.

    >>> import contextlib, io
    >>> err = io.StringIO()
    >>> with contextlib.redirect_stderr(err):
    ...     deprecated("--ranks-per-node 8", "--node 8")
    >>> err.getvalue().startswith("warning: --ranks-per-node 8 is deprecated")
    True
    """
    print(
        f"warning: {old} is deprecated (it goes away in meshgroups {REMOVED_IN}); write {new}",
        file=sys.stderr,
    )


def add_node(parser: argparse.ArgumentParser, what: str) -> None:
    """``--node N`` (and the old ``--ranks-per-node N``, hidden from ``--help``).

    Args:
        parser: a subcommand's parser.
        what: the sentence after "ranks per node (consecutive ranks share a node): ".
    """
    parser.add_argument(
        "--node",
        type=bounded_int("--node", 1, MAX_RANK + 1),
        metavar="N",
        help=f"ranks per node (consecutive ranks share a node): {what} (default: no nodes)",
    )
    parser.add_argument(
        "--ranks-per-node",
        dest="old_ranks_per_node",
        type=bounded_int("--ranks-per-node", 1, MAX_RANK + 1),
        help=argparse.SUPPRESS,
    )


def node_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    """The ranks per node of ``--node`` (or of the old ``--ranks-per-node``, with a warning)."""
    old = getattr(args, "old_ranks_per_node", None)
    if old is not None:
        if args.node is not None and args.node != old:
            parser.error(f"--node {args.node} and --ranks-per-node {old} disagree; give --node only")
        deprecated(f"--ranks-per-node {old}", f"--node {old}")
        return int(old)
    return args.node


def topology_of(
    parser: argparse.ArgumentParser, node: int | None, text: str | None, required: bool = False
) -> Topology | None:
    """The machine of ``--node N`` and ``--topology node=8,domain=32``: ``--topology`` names
    several levels, ``--node`` the first; both together must agree on the node.

    Returns:
        the topology, or None when neither is given (an error when ``required``).
    """
    levels: dict[str, int] = {}
    if text is not None:
        try:
            given = Topology.parse(text)
        except (ValueError, TypeError) as exc:
            parser.error(f"--topology {text!r}: {exc}")
        levels = dict(given.levels)
    if node is not None:
        if "node" in levels and levels["node"] != node:
            parser.error(f"--node {node} but --topology says node={levels['node']}; give one of them")
        levels = {"node": node, **{k: v for k, v in levels.items() if k != "node"}}
    if not levels:
        if required:
            parser.error("give the machine: --node N (ranks per node), or --topology node=8,domain=32")
        return None
    try:
        return Topology(**levels)
    except (ValueError, TypeError) as exc:
        parser.error(f"--node / --topology: {exc}")


def dim_words(parser: argparse.ArgumentParser, words: Sequence[str], option: str) -> list[str]:
    """``name=size`` words as given after ``option``; a word holding commas (the old
    ``pp=2,tp=4``) is split, with a warning naming the new spelling."""
    out: list[str] = []
    old = [w for w in words if "," in w]
    for word in words:
        out += [w for w in word.split(",") if w]
    if old:
        deprecated(f"{option} {' '.join(old)}", f"{option} {' '.join(out)} (name=size words, spaces between)")
    if not out:
        parser.error(f"{option} takes name=size words, e.g. {option} pp=2 tp=4")
    return out


def model_name(parser: argparse.ArgumentParser, name: str) -> str:
    """A preset's name as :data:`meshgroups.models.PRESETS` spells it; an older spelling
    (:data:`meshgroups.models.ALIASES`) with a warning; anything else refused with the list."""
    if name in PRESETS:
        return name
    if name in ALIASES:
        deprecated(f"--model {name}", f"--model {ALIASES[name]}")
        return ALIASES[name]
    parser.error(
        f"--model {name!r} is not a preset{did_you_mean(name, PRESETS, '; ')}; presets are "
        + ", ".join(PRESETS)
    )


#: The help sentence of every ``--model`` option.
MODEL_HELP = "a preset model (meshgroups.models.PRESETS): " + ", ".join(PRESETS)


def dumps(data: Any, level: int = 0) -> str:
    """``data`` as one JSON document: objects and lists of objects one item a line (indented
    by one space a level), a list of numbers or strings on one line.

    Args:
        data: what ``json.dumps`` takes.
        level: the indentation level of the first line.

    Returns:
        the text (``json.loads`` reads it back to ``data``).
    """
    pad, end = " " * (level + 1), " " * level
    if isinstance(data, dict) and data:
        items = [f"{pad}{json.dumps({k: 0})[1:-4]}: {dumps(v, level + 1)}" for k, v in data.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(data, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) and v for v in data):
        return "[\n" + ",\n".join(pad + dumps(v, level + 1) for v in data) + "\n" + end + "]"
    return json.dumps(data)


def print_json(data: Any) -> None:
    """Print ``data`` as one JSON document (:func:`dumps`)."""
    print(dumps(data))
