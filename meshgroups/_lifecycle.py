"""One lifecycle for every object that holds process groups: ``Closeable``.

``MeshGroups``, ``Elastic``, ``Job``, ``TransferGroups``, ``WeightSync`` (and the engines'
objects) hold process groups that only they may destroy. Each is a context manager; ``close()``
is local (no collective, but called on every rank, like the call that built the object),
idempotent, and returns the number of process groups it destroyed on this rank (0 the second
time); ``closed`` says whether it was closed; and using a closed object raises one error,
``ClosedError`` (a ``RuntimeError``), naming the object and what was asked of it::

    >>> class Holder(Closeable):
    ...     def _release(self) -> int:
    ...         return 2  # the groups it destroyed
    >>> with Holder() as h:
    ...     pass
    >>> h.closed, h.close()
    (True, 0)
    >>> h._check_open("sync")
    Traceback (most recent call last):
    ...
    meshgroups.errors.ClosedError: this Holder was closed (sync needs it open): build a new one
"""

from __future__ import annotations

from typing import Any

from meshgroups.errors import ClosedError


class Closeable:
    """The base of every object that holds process groups (see the module docstring).

    A subclass implements ``_release()`` (destroy what it holds; return how many process
    groups it destroyed) and calls ``_check_open(what)`` where a closed object must not serve.
    """

    _closed: bool = False

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called.

        >>> Closeable().closed
        False
        """
        return self._closed

    def close(self) -> int:
        """Destroy what this object holds (local, idempotent; call it on every rank).

        Returns:
            The number of process groups destroyed on this rank (0 when already closed).
        """
        if self._closed:
            return 0
        self._closed = True
        return self._release()

    def _release(self) -> int:
        return 0

    def _check_open(self, what: str) -> None:
        """Raise ``ClosedError`` if closed; ``what`` names the use that was refused."""
        if self._closed:
            raise ClosedError(
                f"this {type(self).__name__} was closed ({what} needs it open): build a new one"
            )

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Closeable"]
