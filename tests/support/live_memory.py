"""Live tensor bytes on one rank, by category, at their peak: a ``TorchDispatchMode`` that counts
every storage an op returns until it is freed (what CUDA's ``memory_allocated`` counts: no
allocator caching, no rounding), the way ``torch.distributed._tools.mem_tracker.MemTracker``
does (storages, a weak reference per storage, ``UntypedStorage.resize_`` watched because FSDP2
frees and re-allocates its unsharded parameters with it).

Each new storage is tagged with the region running when it was made (``with live.region("loss")``
in the harness; ``"activations"`` otherwise, ``"optimizer"`` inside ``optimizer.step``); FSDP2's
buffers (its custom ``fsdp::`` ops, collectives' outputs, storages re-grown by ``resize_``) are
``"transient"``. At the peak the live set is kept, and :meth:`LiveMemory.breakdown` re-labels
it by identity: the storages of the parameters' local shards are ``params``, of their gradients
``grads``, of the optimizer's state ``optimizer``. Test support only (torch imported lazily).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["LiveMemory"]


def _storages(t: Any) -> list[Any]:
    """The storages behind ``t``, through wrapper subclasses (DTensor, functional collectives'
    async tensors) as torch's own memory tracker finds them."""
    import torch
    from torch.distributed._tools.common_utils import get_untyped_storages

    if not isinstance(t, torch.Tensor) or t.is_meta:
        return []
    return [st for st in get_untyped_storages(t) if st.device.type != "meta"]


class LiveMemory:
    """Counts live storages; ``peak`` is the largest sum of live bytes seen, ``at_peak`` what was
    live then (``{key: (bytes, tag)}``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        from torch.utils.weak import WeakIdKeyDictionary

        class _Live(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.live: dict[int, tuple[int, str, str]] = {}
                self.refs: dict[int, Any] = {}
                # a serial per storage (ids of dead storages are reused; serials are not)
                self.serial: Any = WeakIdKeyDictionary()
                self.next = 0
                self.total = 0
                self.peak = 0
                self.at_peak: dict[int, tuple[int, str, str]] = {}
                self.tags = ["activations"]
                self.trace: list[tuple[str, str, int]] | None = None  # (op, tag, total) when set
                self.fsdp: list[bool] = []  # the record_function ranges open, FSDP2's or not
                self.op: Any = "(before)"
                self.peak_where: tuple[str, str] = ("", "")
                self._resize = torch.UntypedStorage.resize_

            # -- bookkeeping
            def _key(self, st: Any) -> int:
                key = self.serial.get(st)
                if key is None:
                    key = self.serial[st] = self.next
                    self.next += 1
                return key

            def add(self, st: Any, tag: str) -> None:
                key = self._key(st)
                if key in self.live:
                    return
                n = st.nbytes()
                self.live[key] = (n, tag, str(self.op))
                self.refs[key] = weakref.ref(st, lambda _r, k=key: self._gone(k))
                self.total += n
                self._mark()

            def _gone(self, key: int) -> None:
                n = self.live.pop(key, (0, "", ""))[0]
                self.refs.pop(key, None)
                self.total -= n

            def _mark(self) -> None:
                if self.total > self.peak:
                    self.peak = self.total
                    self.at_peak = dict(self.live)
                    self.peak_where = (str(self.op), self.tags[-1])

            def track(self, tensors: Iterable[Any], tag: str) -> None:
                """Count tensors made before the mode was entered (parameters, optimizer state)."""
                for t in tensors:
                    for st in _storages(t):
                        self.add(st, tag)

            def set(self, tag: str) -> None:
                """Tag what is made from now on (hooks switch between regions with it)."""
                self.tags[-1] = tag

            def instrument(self, net: Any, optimizer: Any = None) -> None:
                """Hooks that tag by region: blocks and the embedding ``activations``, the head
                and the loss ``loss`` (forward, and backward until the final norm's gradient
                arrives), ``optimizer.step`` ``optimizer``."""
                for m in (net.embedding, *net.layers):
                    m.register_forward_pre_hook(lambda *_: self.set("activations"))
                net.head.register_forward_pre_hook(lambda *_: self.set("loss"))
                net.final_norm.register_full_backward_pre_hook(lambda *_: self.set("activations"))
                if optimizer is not None:
                    optimizer.register_step_pre_hook(lambda *_: self.set("optimizer"))
                    optimizer.register_step_post_hook(lambda *_: self.set("activations"))

            @contextlib.contextmanager
            def region(self, tag: str) -> Iterator[None]:
                self.tags.append(tag)
                try:
                    yield
                finally:
                    self.tags.pop()

            def retag(self, t: Any, tag: str) -> None:
                """Re-label ``t``'s storage, now and in the peak's snapshot (FSDP2's unsharded
                gradients are autograd's outputs: a hook names them once they exist)."""
                for st in _storages(t):
                    key = self._key(st)
                    for table in (self.live, self.at_peak):
                        if key in table:
                            n, _, op = table[key]
                            table[key] = (n, tag, op)

            def reset_peak(self) -> None:
                self.peak = self.total
                self.at_peak = dict(self.live)

            def __enter__(self) -> Any:
                mode = self
                orig = self._resize

                def resize_(st: Any, size: int) -> Any:
                    out = orig(st, size)
                    key = mode._key(st)
                    if key in mode.live:
                        n, tag, op = mode.live[key]
                        mode.total += st.nbytes() - n
                        mode.live[key] = (st.nbytes(), "transient" if size else tag, op)
                        mode._mark()
                    elif size:
                        mode.add(st, "transient")
                    return out

                torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
                return super().__enter__()

            def __exit__(self, *args: Any) -> Any:
                torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
                return super().__exit__(*args)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if any(t.__name__ == "DTensor" for t in types):
                    return NotImplemented  # DTensor runs its local ops, which come back here
                out = func(*args, **(kwargs or {}))
                ns = func._overloadpacket._qualified_op_name.split("::")[0]
                name = func._overloadpacket._qualified_op_name
                if name == "profiler::_record_function_enter_new":
                    # FSDP2 runs its hooks inside record_function("FSDP::..."): what they make
                    # (gathered parameters, all-gather buffers, reduce-scatter buffers) is its
                    self.fsdp.append(str(args[0]).startswith("FSDP::"))
                elif name == "profiler::_record_function_exit" and self.fsdp:
                    self.fsdp.pop()
                tag = self.tags[-1]
                if ns == "fsdp" or any(self.fsdp):
                    tag = "transient"
                self.op = func
                flat, _ = tree_flatten(out)
                for t in flat:
                    if isinstance(t, torch.Tensor):
                        for st in _storages(t):
                            self.add(st, tag)
                if self.trace is not None:
                    self.trace.append((str(func), tag, self.total))
                return out

            def breakdown(self, **known: Iterable[Any]) -> dict[str, int]:
                """Bytes live at the peak by category: ``known`` names tensors by category
                (``params=[...]``, ``grads=[...]``, ``optimizer=[...]``), the rest by tag."""
                label: dict[int, str] = {}
                for cat, tensors in known.items():
                    for t in tensors:
                        for st in _storages(t):
                            label[self._key(st)] = cat
                out: dict[str, int] = {}
                for key, (n, tag, _) in self.at_peak.items():
                    cat = label.get(key, tag)
                    out[cat] = out.get(cat, 0) + n
                return out

        return _Live(*args, **kwargs)
