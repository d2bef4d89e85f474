"""One collective call's plan, made once: its options checked on this rank, in the order torch
checks them, then ``make_plan`` (``plan_build``); a later build's plan derived from an earlier
one, never from its fields given again (``plan_more``).

Both run inside the collective call (``meshgroups.mesh._collective``) that builds the plan, so a
bad option on one rank is the same error on every rank; both first give the call the plan's
liveness settings, which every wait of the call uses, a failed call's close included.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from meshgroups.errors import DeviceTypeError, MeshConfigError, torch_says
from meshgroups.layout import Layout
from meshgroups.mesh._collective import Call
from meshgroups.mesh._groups import GroupCache
from meshgroups.mesh._options import MeshOptions, check_settings
from meshgroups.mesh._plan import BackendConfig, BuildPlan, SubsetSpec, as_timedelta, make_plan
from meshgroups.mesh._strategies import make_strategy
from meshgroups.mesh._torch_seam import default_backend_name, default_timeout, is_backend_options


def plan_build(
    call: Call,
    layout: Layout,
    options: MeshOptions,
    *,
    flatten: Iterable[Sequence[str]] = (),
    subsets: Mapping[str, SubsetSpec] | None = None,
    only: Iterable[Sequence[str]] | None = None,
    cache: object = None,
) -> BuildPlan:
    """The plan of ``init_mesh(layout, options=options, ...)``, made inside ``call``.

    Args:
        call: the running collective call; its waits take the options' liveness settings first.
        layout, flatten, subsets, only: what to build (``init_mesh``'s arguments).
        options: how to build it; every field is checked here.
        cache: ``init_mesh``'s ``cache``, checked among the options (``build`` takes it).

    Returns:
        The ``BuildPlan``: the families and the options every rank must agree on.

    Raises:
        TypeError, MeshConfigError, DeviceTypeError, BackendOverrideError: a bad argument.

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from meshgroups.mesh._collective import collective_call
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    >>> with collective_call("init_mesh") as call:
    ...     plan = plan_build(call, Layout(dp=2, tp=2), MeshOptions(timeout=30, strategy="global"))
    >>> [spec.key for spec in plan.specs], plan.timeout.total_seconds(), plan.strategy
    ([('dp',), ('tp',)], 30.0, 'global')
    >>> dist.destroy_process_group()
    """
    liveness = check_settings(options.heartbeat, options.lease, options.report_every)
    call.use_liveness(*liveness)  # first: a failed call's close waits with them too
    if not isinstance(options.partial, bool):
        raise TypeError(f"partial must be True or False, got {options.partial!r}")
    fake = default_backend_name() == "fake"
    check = options.check
    if check is not None and not isinstance(check, bool):
        raise TypeError(f"check must be True, False or None, got {check!r}")
    if check is False and not fake:
        # A rank that skipped the meeting would leave the others waiting (or pair with their
        # next call): every call meets, so the check cannot be turned off on a real backend.
        raise MeshConfigError(
            "check=False is only allowed on torch's 'fake' backend: on a real backend every call "
            "meets the other ranks (that is what keeps calls in step); leave check at None or True"
        )
    device_type = options.device_type
    check_device_index(device_type)  # first, as torch (and before the default group, in init_mesh)
    timeout = as_timedelta(options.timeout, default_timeout())
    check_options(device_type, options.backend, options.gloo_twins, cache, fake)
    given = options.backend_override
    # As init_mesh always took it (``MeshOptions.kwargs()``): a plain dict of the value.
    overrides = normalize_overrides(None if given is None else dict(given))
    strategy = make_strategy(options.strategy).name  # "auto" resolved: every later build uses it
    plan = make_plan(
        layout,
        device_type=device_type,
        flatten=flatten,
        subsets=subsets,
        only=only,
        backend=options.backend,
        strategy=strategy,
        gloo_twins=options.gloo_twins,
        timeout=timeout,
        backend_override=overrides,
        partial=options.partial,
        liveness=liveness,
    )
    check_override_names(overrides)  # after the keys (make_plan), as torch: a bad key is told first
    return plan


def plan_more(
    call: Call,
    earlier: BuildPlan,
    layout: Layout,
    only: Iterable[Sequence[str]],
    labels: Mapping[Hashable, str] | None = None,
    backend_override: Mapping[str, BackendConfig] | None = None,
) -> BuildPlan:
    """The plan of a later build (``MeshGroups.flatten``, torch's ``_flatten``/``_unflatten``)
    of the families ``only`` over ``layout``, inside ``call``, with the ``earlier`` plan's
    options (``BuildPlan.more``): only what is new is checked, ``backend_override``.

    Args:
        call: the running collective call; its waits take the earlier plan's liveness first.
        earlier: the plan of the mesh's ``init_mesh``.
        layout, only: the layout (one the mesh holds, or torch's rows) and its families.
        labels: the families' names (their group description, torch's ``mesh_<name>``).
        backend_override: torch's normalised override of those families, keyed by ``labels``.

    Returns:
        The derived ``BuildPlan``.

    >>> import torch.distributed as dist
    >>> from torch.testing._internal.distributed.fake_pg import FakeStore
    >>> from meshgroups.mesh._collective import collective_call
    >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    >>> with collective_call("init_mesh") as call:
    ...     first = plan_build(call, Layout(dp=2, tp=2), MeshOptions(timeout=30, strategy="global"))
    ...     later = plan_more(call, first, first.layout, [("dp", "tp")], backend_override={"dp_tp": "gloo"})
    >>> later.specs[0].backend, later.timeout == first.timeout, later.strategy
    (('gloo', None), True, 'global')
    >>> dist.destroy_process_group()
    """
    call.use_liveness(*earlier.liveness)  # first, as plan_build: the earlier plan's settings
    overrides = normalize_overrides(backend_override)
    plan = earlier.more(layout, only, labels, overrides)
    check_override_names(overrides)
    return plan


def normalize_overrides(value: object) -> dict[int | str, BackendConfig]:
    """torch's ``backend_override`` forms as ``{dim: (backend, options)}``: a value is a backend
    name, backend options, or ``(name, options)`` (either part ``None``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"backend_override must map dim names or indices to a backend, e.g. {{'tp': 'gloo'}}; got {value!r}"
        )
    out: dict[int | str, BackendConfig] = {}
    for key, given in value.items():
        config: BackendConfig
        if isinstance(given, str):
            config = (given, None)
        elif is_backend_options(given):
            config = (None, given)
        elif (
            isinstance(given, tuple)
            and len(given) == 2
            and (given[0] is None or isinstance(given[0], str))
            and (given[1] is None or is_backend_options(given[1]))
        ):
            config = (given[0], given[1])
        else:
            raise TypeError(
                f"backend_override[{key!r}] must be a backend name, backend options or (name, options), "
                f"got {given!r}"
            )
        out[key] = config  # backend names are checked once the keys are (check_override_names)
    return out


def check_override_names(overrides: Mapping[int | str, BackendConfig]) -> None:
    """Refuse an override naming a backend torch does not know (``MeshConfigError``)."""
    for key, (name, _) in overrides.items():
        if name is not None:
            check_backend_name(name, f"backend_override[{key!r}]")


def check_device_index(device_type: object) -> None:
    """A device type with an index (``"cuda:0"``) is refused before anything else, as torch's
    ``init_device_mesh`` refuses it (whether or not a default group exists).

    Raises:
        DeviceTypeError: ``device_type`` carries an index.
    """
    if isinstance(device_type, str) and ":" in device_type:
        raise DeviceTypeError(
            torch_says(
                f"device_type={device_type!r}: give the device type only, e.g. 'cpu' or 'cuda'",
                f"Device type with index is not supported but got {device_type}. "
                "If you maintained a 'torch.device' object, it's recommended to pass in 'device.type'.",
            )
        )


def check_options(
    device_type: object, backend: object, gloo_twins: object, cache: object, fake: bool = False
) -> None:
    """Refuse bad ``init_mesh`` options before any collective.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ... (a device type this torch can run, no index).
        backend: a backend name or ``"cpu:gloo,cuda:nccl"``-style string, or None (the default group's).
        gloo_twins: whether to build a gloo twin of every group (a bool).
        cache: a ``GroupCache`` or None.
        fake: True on torch's ``fake`` backend (the device check is skipped there).

    Raises:
        TypeError: a value of the wrong type.
        DeviceTypeError: a device type with an index, or one this torch cannot run.
        MeshConfigError: an unknown backend name.
    """
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
    check_device_index(device_type)
    try:
        torch.device(device_type)
    except RuntimeError:
        raise DeviceTypeError(
            f"device_type={device_type!r} is not a torch device type (e.g. 'cpu', 'cuda', 'xpu')"
        ) from None
    if device_type not in ("cpu", "meta") and not fake:
        available = getattr(getattr(torch, device_type, None), "is_available", None)
        if not callable(available) or not available():
            raise DeviceTypeError(
                f"device_type={device_type!r}: this torch ({torch.__version__}) cannot run on "
                f"{device_type!r} here (torch.{device_type}.is_available() is not True); use 'cpu'"
            )
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str such as 'gloo' or 'cpu:gloo,cuda:nccl', got {backend!r}")
        check_backend_name(backend, "backend")
    if not isinstance(gloo_twins, bool):
        raise TypeError(f"gloo_twins must be True or False, got {gloo_twins!r}")
    if cache is not None and not isinstance(cache, GroupCache):
        raise TypeError(f"cache must be a meshgroups.GroupCache or None, got {type(cache).__name__}")


def check_backend_name(backend: str, what: str) -> None:
    """Refuse a backend string naming a backend torch does not know.

    Args:
        backend: ``"gloo"``, ``"nccl"``, or ``"cpu:gloo,cuda:nccl"``-style.
        what: how the error names the argument (``"backend"``, ``"backend_override['tp']"``).

    Raises:
        MeshConfigError: a part names no backend of ``torch.distributed``.
    """
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    for part in backend.split(","):
        name = part.rsplit(":", 1)[-1].strip().lower()
        if name not in known:
            raise MeshConfigError(
                f"{what}={backend!r}: {name!r} is not a registered backend ({', '.join(known)})"
            )
