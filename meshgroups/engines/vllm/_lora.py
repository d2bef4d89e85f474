"""LoRA adapters into vLLM's LoRA slots, and LoRA merged into the base (vLLM-free on import).

**Adapter sync** (``VLLMWeightSync(..., lora=LoRA(...))``): the trainer's LoRA A/B weights —
PEFT's, sharded as the trainer holds them (FSDP2 DTensors, or plain tensors) and named as a
PEFT checkpoint names them (:func:`lora_weights`) — are the source; the destination is the
whole adapter on every engine worker (an adapter is small; vLLM's own loader cuts each
worker's slice of a tensor-parallel layer from whole A/B tensors, as it does for an adapter
read from disk). After a complete sync each worker keeps the adapter in PEFT's files where
vLLM's own loader reads it (:func:`install`; vLLM clears its adapters after every weight update,
so an adapter put straight into its cache would not outlive the update that made it); a request
naming it (``VLLMWeightSync.lora_request()``: ``LoRA.adapter_id(version)``, its directory) makes
vLLM load it into a slot, replacing the adapter of that id. The base model is untouched.
``keep=k`` rotates ``k`` ids so that the last ``k`` versions stay servable (requests in flight on
an older version keep theirs: vLLM's ``max_loras`` must then be at least ``k``, TRL's
``max_loras >= max_staleness + 1``).

**Merged** (:func:`merged_weights`): ``W + scale · B · A`` in the base's names, computed on
each trainer rank for its own shard of ``W`` only (A and B are gathered whole: they are small),
so no full merged weight exists anywhere and the plan cuts each rollout shard from the
senders' merged shards as for any weight. The arithmetic is elementwise and in a fixed order
(:func:`merge`): any shard's elements equal the full merge's bit for bit.

    >>> LoRA("policy", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, keep=2).adapter_id(3)
    1
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from meshgroups.engines.vllm._destination import engine_destinations
from meshgroups.errors import LayoutError
from meshgroups.transfer import NameMap, Weight


@dataclass(frozen=True)
class LoRA:
    """The adapter a ``VLLMWeightSync`` writes into vLLM's LoRA slots (see the module docstring).

    ``keep=2``: versions take ids 1 and 2 in turn, so the last two stay servable::

        >>> lora = LoRA("policy", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, keep=2)
        >>> [lora.adapter_id(v) for v in (1, 2, 3)], lora.request_name(3)
        ([1, 2, 1], 'policy-v3')

    Attributes:
        name: the adapter's name (requests name it ``f"{name}-v{version}"``).
        config: its PEFT config as a dict (``r``, ``lora_alpha``, ``target_modules``, ...:
            :func:`lora_config`).
        first_id: vLLM's ``lora_int_id`` of the first slot (>= 1).
        keep: how many versions stay servable (ids ``first_id .. first_id + keep - 1``).
        root: the directory on each worker's machine where the workers keep the adapter's
            versions (default: ``meshgroups-lora`` in the temporary directory).
    """

    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    first_id: int = 1
    keep: int = 1
    root: str = field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "meshgroups-lora"))

    def __post_init__(self) -> None:
        for what, value in (("first_id", self.first_id), ("keep", self.keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoRA({what}={value!r}): an int >= 1")
        if "r" not in self.config or "lora_alpha" not in self.config:
            raise ValueError(
                f"LoRA(config=...) needs PEFT's r and lora_alpha, got keys {sorted(self.config)}"
            )

    def adapter_id(self, version: int) -> int:
        """vLLM's ``lora_int_id`` of ``version`` (versions from 1)."""
        return self.first_id + (version - 1) % self.keep

    def request_name(self, version: int) -> str:
        """The ``lora_name`` of ``version``."""
        return f"{self.name}-v{version}"

    def spec(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        """What travels to the workers (plain data): this adapter and its tensors' shapes."""
        return {"name": self.name, "config": dict(self.config), "first_id": self.first_id, "keep": self.keep,
                "root": self.root, "shapes": {n: tuple(s) for n, s in sorted(shapes.items())}}  # fmt: skip

    def request(self, version: int) -> Any:
        """vLLM's ``LoRARequest`` of ``version`` (imports vLLM)."""
        from vllm.lora.request import LoRARequest

        path = adapter_dir({"root": self.root, "name": self.name}, version)
        return LoRARequest(self.request_name(version), self.adapter_id(version), path)


def checkpoint_name(name: str, adapter: str = "default") -> str | None:
    """A PEFT model's parameter name as its checkpoint names it (``None``: no LoRA weight).

    >>> checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    """
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.{adapter}."
        if marker in name:
            return name.replace(marker, f".{part}.")
    return None


def lora_weights(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """A PEFT model's LoRA A/B parameters by checkpoint name (the same tensors: DTensors stay
    DTensors): the source of an adapter sync.

    >>> import torch
    >>> from types import SimpleNamespace
    >>> q = torch.nn.Module()  # a PEFT-wrapped layer's parameters (peft.get_peft_model makes them)
    >>> q.base_layer = torch.nn.Linear(4, 4, bias=False)
    >>> q.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2, bias=False)})
    >>> q.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 4, bias=False)})
    >>> model = torch.nn.Module()
    >>> model.q_proj = q
    >>> model.peft_config = {"default": SimpleNamespace(r=2, lora_alpha=4, target_modules={"q_proj"},
    ...     bias="none", use_rslora=False, modules_to_save=None)}
    >>> sorted(lora_weights(model))
    ['q_proj.lora_A.weight', 'q_proj.lora_B.weight']
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        ckpt = checkpoint_name(name, adapter)
        if ckpt is not None:
            out[ckpt] = p
    if not out:
        raise LayoutError(f"the model has no LoRA weights of adapter {adapter!r} (PEFT's lora_A/lora_B)")
    return out


def lora_config(model: torch.nn.Module, adapter: str = "default") -> dict[str, Any]:
    """A PEFT model's adapter config as the plain dict vLLM reads (``adapter_config.json``).

    >>> import torch
    >>> from types import SimpleNamespace
    >>> q = torch.nn.Module()  # a PEFT-wrapped layer's parameters (peft.get_peft_model makes them)
    >>> q.base_layer = torch.nn.Linear(4, 4, bias=False)
    >>> q.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2, bias=False)})
    >>> q.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 4, bias=False)})
    >>> model = torch.nn.Module()
    >>> model.q_proj = q
    >>> model.peft_config = {"default": SimpleNamespace(r=2, lora_alpha=4, target_modules={"q_proj"},
    ...     bias="none", use_rslora=False, modules_to_save=None)}
    >>> config = lora_config(model)
    >>> config["r"], config["lora_alpha"], config["target_modules"]
    (2, 4, ['q_proj'])
    """
    cfg: Any = model.peft_config[adapter]  # type: ignore[index]
    targets = cfg.target_modules
    return {
        "r": int(cfg.r),
        "lora_alpha": cfg.lora_alpha,
        "target_modules": targets if isinstance(targets, str) else sorted(targets),
        "bias": cfg.bias,
        "use_rslora": bool(cfg.use_rslora),
        "use_dora": bool(getattr(cfg, "use_dora", False)),
        "modules_to_save": None if cfg.modules_to_save is None else list(cfg.modules_to_save),
    }


def lora_destinations(spec: Mapping[str, Any], offers: list[Any], dtype: str | None = None) -> list[Weight]:
    """The adapter's destination: each tensor whole on every worker, in the engine's LoRA dtype
    — the same on every rank that computes it, trainer or worker.

    Args:
        spec: ``LoRA.spec(...)``.
        offers: each worker's LoRA capability (``{"max_rank", "dtype"}``, ``None``: LoRA off).
        dtype: override of the engine's dtype (tests).

    Raises:
        LayoutError: an engine without LoRA, a rank above its ``max_lora_rank``.
    """
    if any(o is None for o in offers):
        raise LayoutError(
            f"LoRA adapter {spec['name']!r}: the engine serves no LoRA adapters; start it with enable_lora=True "
            f"(and max_lora_rank >= {spec['config'].get('r')}), or sync the adapter merged into the base "
            "(meshgroups.engines.vllm.merged_weights)"
        )
    r = int(spec["config"]["r"])
    top = min(int(o["max_rank"]) for o in offers)
    if r > top:
        raise LayoutError(
            f"LoRA adapter {spec['name']!r} has rank {r}, above the engine's max_lora_rank={top}"
        )
    wire = dtype or offers[0]["dtype"]
    return [Weight(n, tuple(s), wire, {}) for n, s in spec["shapes"].items()]


def offered_destination(trainer: Any, offers: list[Any], tp: int) -> tuple[list[Weight], NameMap]:
    """The destination every rank derives from the init offers (``_protocol``): the adapter
    (:func:`lora_destinations`) when the trainer offers one, else the engine's parameters
    through the family map (``engine_destinations``) — the same on every rank, or the same
    ``LayoutError``."""
    if trainer.lora is not None:
        return lora_destinations(trainer.lora, [o.lora for o in offers]), NameMap()
    family = None if trainer.family is None else NameMap.loads(trainer.family)
    return engine_destinations([o.params for o in offers], tp, family)


def adapter_dir(spec: Mapping[str, Any], version: int) -> str:
    """Where the workers keep ``version`` of the adapter (``LoRA.root``/``name-vN``)."""
    return os.path.join(spec["root"], f"{spec['name']}-v{version}")


def install(
    tensors: Mapping[str, torch.Tensor], spec: Mapping[str, Any], version: int, vllm_config: Any
) -> str:
    """Keep the adapter held in ``tensors`` as ``version`` where vLLM's own LoRA loader reads it
    (PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``, each file written
    atomically: the workers of one machine write the same bytes), check it against the
    engine's LoRA config, and drop the versions older than ``keep``. Returns its directory.

    Why files and not vLLM's adapter cache: vLLM clears every adapter after each weight update
    (``reset_lora_state`` in ``finish_weight_update``), the one that makes the adapter included;
    vLLM loads an adapter a request names by its path, then caches it by id.

    Raises:
        LayoutError: the adapter's config is not one the engine serves (rank, modules).
    """
    from safetensors.torch import save_file
    from vllm.lora.peft_helper import PEFTHelper

    path = adapter_dir(spec, version)
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", **dict(spec["config"])}
    tmp = f".tmp-{os.getpid()}"
    with open(os.path.join(path, "adapter_config.json" + tmp), "w") as f:
        json.dump(config, f)
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, os.path.join(path, "adapter_model.safetensors" + tmp)
    )
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        os.replace(os.path.join(path, name + tmp), os.path.join(path, name))
    try:
        PEFTHelper.from_local_dir(path, vllm_config.model_config.max_model_len).validate_legal(
            vllm_config.lora_config
        )
    except ValueError as exc:
        raise LayoutError(f"LoRA adapter {spec['name']!r} version {version}: vLLM refuses it: {exc}") from exc
    old = version - int(spec["keep"])
    if old >= 1:
        shutil.rmtree(adapter_dir(spec, old), ignore_errors=True)  # another worker may be at it too
    return path


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``w + scale · b @ a`` in float32, elementwise in a fixed order (the rank's terms added
    one by one, then scaled and added to ``w``): each element's value does not depend on the
    shapes, so a shard of the merge equals the full merge's elements bit for bit.

    Args:
        w: ``[out, in]`` (or a shard: the rows ``b`` and the columns ``a`` give).
        a: ``[r, in]`` (its columns of ``w``'s shard).
        b: ``[out, r]`` (its rows of ``w``'s shard).
        scale: ``lora_alpha / r`` (or rsLoRA's).

    >>> merge(torch.zeros(2, 2), torch.ones(1, 2), torch.ones(2, 1), 0.5).tolist()
    [[0.5, 0.5], [0.5, 0.5]]
    """
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    acc = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    for k in range(a32.shape[0]):
        acc += b32[:, k : k + 1] * a32[k : k + 1, :]
    return w.to(torch.float32) + acc * scale


def scaling(config: Mapping[str, Any]) -> float:
    """PEFT's scale of an adapter: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` (rsLoRA)."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / (r**0.5) if config.get("use_rslora") else alpha / r


def merged_weights(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """A PEFT model's base weights in the base model's names (``base_model.model.`` and
    ``.base_layer`` dropped), the LoRA-targeted ones merged (:func:`merge`) on this rank's own
    shard only; a DTensor stays a DTensor of the same placements (float32). The LoRA A/B
    themselves are gathered whole (``full_tensor()``: collective over their mesh).

    >>> import torch
    >>> from types import SimpleNamespace
    >>> q = torch.nn.Module()  # a PEFT-wrapped layer's parameters (peft.get_peft_model makes them)
    >>> q.base_layer = torch.nn.Linear(4, 4, bias=False)
    >>> q.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2, bias=False)})
    >>> q.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 4, bias=False)})
    >>> model = torch.nn.Module()
    >>> model.q_proj = q
    >>> model.peft_config = {"default": SimpleNamespace(r=2, lora_alpha=4, target_modules={"q_proj"},
    ...     bias="none", use_rslora=False, modules_to_save=None)}
    >>> merged = merged_weights(model)  # W + (lora_alpha / r) · B · A
    >>> want = q.base_layer.weight + 2.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    >>> sorted(merged), torch.allclose(merged["q_proj.weight"], want)
    (['q_proj.weight'], True)
    """
    from torch.distributed.tensor import DTensor

    from meshgroups.mesh import local_shape_and_offset

    params: dict[str, Any] = dict(model.named_parameters())
    config: Any = model.peft_config[adapter]  # type: ignore[index]
    scale = scaling({"r": config.r, "lora_alpha": config.lora_alpha, "use_rslora": config.use_rslora})
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in params.items():
            if checkpoint_name(name, adapter) is not None or ".lora_" in name:
                continue
            base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            owner = name.rsplit(".", 1)[0].removesuffix(".base_layer")
            a_name, b_name = f"{owner}.lora_A.{adapter}.weight", f"{owner}.lora_B.{adapter}.weight"
            if not name.endswith(".base_layer.weight") or a_name not in params:
                out[base] = p
                continue
            a, b = (
                params[n].full_tensor() if isinstance(params[n], DTensor) else params[n]
                for n in (a_name, b_name)
            )
            if isinstance(p, DTensor):
                if any(type(pl).__name__ == "_StridedShard" for pl in p.placements):
                    raise LayoutError(
                        f"merged LoRA: {base!r} is a strided shard (FSDP2 over a tensor-parallel shard); merge "
                        "takes plain Shard/Replicate placements (FSDP2 or TP alone)"
                    )
                shape, offset = local_shape_and_offset(p)
                rows = slice(offset[0], offset[0] + shape[0])
                cols = slice(offset[1], offset[1] + shape[1])
                local = merge(p.to_local(), a[:, cols], b[rows, :], scale)
                out[base] = DTensor.from_local(
                    local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            else:
                out[base] = merge(p, a, b, scale)
    return out


__all__ = [
    "LoRA",
    "checkpoint_name",
    "install",
    "lora_config",
    "lora_destinations",
    "lora_weights",
    "merge",
    "merged_weights",
    "offered_destination",
    "scaling",
]
