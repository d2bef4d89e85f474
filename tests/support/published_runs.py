"""Published training runs with their measured peak memory, and what the cost model says of them.

Each run is as its report states it: model, layout, batch, sequence, recomputation, precision,
the peak it measured and whether that figure is allocated or reserved (torchtitan logs
``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``), the device's capacity, and whether it
ran or ran out of memory. The cost model predicts peak *allocated*; a reserved figure is
compared with the prediction times ``RESERVED_OVERHEAD`` (one factor for every reserved row: the
caching allocator's rounding, fragmentation and per-stream pools, which it does not model).

``python -m tests.support.published_runs`` prints the markdown table of ``docs/cost.md``
(between its ``<!-- published-runs -->`` markers); ``tests/cost/test_cost_published.py`` checks that
the page shows the current predictions, that each is within ``TOLERANCE`` of its measurement,
and that no run that ran is called out of memory and no run that did not is called a fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshgroups import Layout
from meshgroups.cost import Parallelism, Precision, fit, peak_memory, preset
from meshgroups.models import Model

__all__ = ["RESERVED_OVERHEAD", "RUNS", "TOLERANCE", "Run", "markdown", "predict"]

GiB = 2**30
#: reserved / allocated assumed for reserved figures (see the module docstring)
RESERVED_OVERHEAD = 1.2
#: a prediction may differ from its measurement by this share
TOLERANCE = 0.15
H100_96GB = 95.0  # GiB the device reports (torch.cuda.get_device_properties().total_memory)
A100_80GB = 79.2

TORCHTITAN_2412 = (
    "https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/benchmarks/"
    "llama3_h100_202412_torchtitan.md"
)
TORCHTITAN_PERF = (
    "https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/docs/performance.md"
)


@dataclass(frozen=True)
class Run:
    """One published run.

    Args:
        label: what the report calls it. model: the model (as the run trains it). sizes: the
            layout's role sizes. plan: how the step runs. capacity: the device's GiB.
        measured: the peak the report gives, GiB (``None``: the report says only whether it
            ran). kind: ``"reserved"`` or ``"allocated"``. outcome: ``"ran"`` or ``"oom"``.
        source: the report's address. notes: settings the cost model does not model.
    """

    label: str
    model: Model
    sizes: dict[str, int]
    plan: Parallelism
    capacity: float
    measured: float | None
    kind: str
    outcome: str
    source: str
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _titan(model: str, **changes: Any) -> Model:
    # torchtitan's Llama: separate q, k, v and gate, up projections
    return preset(model).with_(fused_projections=False, **changes)


FSDP2 = Precision.fsdp2()


def _plan(**kw: Any) -> Parallelism:
    return Parallelism(precision=FSDP2, **kw)


RUNS: list[Run] = [
    # torchtitan, Llama 3.1 8B/70B on H100 96GB, December 2024 (memory: max reserved)
    Run("8B, FSDP 8, local batch 2, selective op", _titan("llama3-8b", micro_batch=2), {"dp_shard": 8},
        _plan(recompute="op"), H100_96GB, 82.4, "reserved", "ran", TORCHTITAN_2412),
    Run("8B, FSDP 8, local batch 2, selective op, compile", _titan("llama3-8b", micro_batch=2), {"dp_shard": 8},
        _plan(recompute="op"), H100_96GB, 77.0, "reserved", "ran", TORCHTITAN_2412, "torch.compile"),
    Run("8B, FSDP 8, local batch 2, selective op, compile, float8", _titan("llama3-8b", micro_batch=2),
        {"dp_shard": 8}, _plan(recompute="op"), H100_96GB, 76.8, "reserved", "ran", TORCHTITAN_2412,
        "torch.compile, float8 linears"),
    Run("8B, FSDP 8, seq 32768, full", _titan("llama3-8b", seq_len=32768), {"dp_shard": 8},
        _plan(recompute="full"), H100_96GB, 83.9, "reserved", "ran", TORCHTITAN_2412, "torch.compile, float8 linears"),
    Run("8B, FSDP 4 × CP 2, seq 65536, full", _titan("llama3-8b", seq_len=65536), {"dp_shard": 4, "cp": 2},
        _plan(recompute="full"), H100_96GB, 84.2, "reserved", "ran", TORCHTITAN_2412, "torch.compile, float8 linears"),
    Run("8B, FSDP 2 × CP 4, seq 131072, full", _titan("llama3-8b", seq_len=131072), {"dp_shard": 2, "cp": 4},
        _plan(recompute="full"), H100_96GB, 84.0, "reserved", "ran", TORCHTITAN_2412, "torch.compile, float8 linears"),
    Run("8B, CP 8, seq 262144, full", _titan("llama3-8b", seq_len=262144), {"dp_shard": 1, "cp": 8},
        _plan(recompute="full"), H100_96GB, 84.5, "reserved", "ran", TORCHTITAN_2412, "torch.compile, float8 linears"),
    Run("8B, FSDP 128, local batch 2, selective op", _titan("llama3-8b", micro_batch=2), {"dp_shard": 128},
        _plan(recompute="op"), H100_96GB, 67.0, "reserved", "ran", TORCHTITAN_2412),
    Run("8B, FSDP 128, local batch 2, selective op, compile", _titan("llama3-8b", micro_batch=2),
        {"dp_shard": 128}, _plan(recompute="op"), H100_96GB, 62.0, "reserved", "ran", TORCHTITAN_2412, "torch.compile"),
    Run("8B, FSDP 128, local batch 2, selective op, compile, float8", _titan("llama3-8b", micro_batch=2),
        {"dp_shard": 128}, _plan(recompute="op"), H100_96GB, 61.8, "reserved", "ran", TORCHTITAN_2412,
        "torch.compile, float8 linears"),
    Run("70B, FSDP 32 × TP 8, local batch 16, full", _titan("llama3-70b", micro_batch=16), {"dp_shard": 32, "tp": 8},
        _plan(recompute="full", sequence_parallel=True), H100_96GB, 71.9, "reserved", "ran", TORCHTITAN_2412,
        "torch.compile, float8 linears"),
    Run("70B, FSDP 32 × TP 8, local batch 16, full, async TP", _titan("llama3-70b", micro_batch=16),
        {"dp_shard": 32, "tp": 8}, _plan(recompute="full", sequence_parallel=True), H100_96GB, 67.6, "reserved", "ran",
        TORCHTITAN_2412, "torch.compile, float8 linears, async TP"),
    # torchtitan, Llama 2 and 3 on 64 A100 80GB, 2024 (ran or out of memory; no figure)
    Run("Llama 2 13B, FSDP 64, local batch 2, no recomputation", _titan("llama2-13b", micro_batch=2),
        {"dp_shard": 64}, _plan(), A100_80GB, None, "reserved", "ran", TORCHTITAN_PERF),
    Run("Llama 2 13B, FSDP 64, local batch 2, selective layer", _titan("llama2-13b", micro_batch=2),
        {"dp_shard": 64}, _plan(recompute="layer"), A100_80GB, None, "reserved", "ran", TORCHTITAN_PERF),
    Run("Llama 2 13B, FSDP 64, local batch 2, selective op", _titan("llama2-13b", micro_batch=2),
        {"dp_shard": 64}, _plan(recompute="op"), A100_80GB, None, "reserved", "ran", TORCHTITAN_PERF),
    Run("Llama 2 70B, FSDP 64, local batch 1, selective op", _titan("llama2-70b"), {"dp_shard": 64},
        _plan(recompute="op"), A100_80GB, None, "reserved", "ran", TORCHTITAN_PERF),
    Run("Llama 2 70B, FSDP 64, local batch 2, selective op", _titan("llama2-70b", micro_batch=2), {"dp_shard": 64},
        _plan(recompute="op"), A100_80GB, None, "reserved", "oom", TORCHTITAN_PERF),
    Run("Llama 2 70B, FSDP 64, local batch 2, full", _titan("llama2-70b", micro_batch=2), {"dp_shard": 64},
        _plan(recompute="full"), A100_80GB, None, "reserved", "ran", TORCHTITAN_PERF),
    Run("Llama 3 8B, FSDP 64, local batch 1, selective layer", _titan("llama3-8b"), {"dp_shard": 64},
        _plan(recompute="layer"), A100_80GB, None, "reserved", "ran", TORCHTITAN_PERF),
    Run("Llama 3 8B, FSDP 64, local batch 1, selective op", _titan("llama3-8b"), {"dp_shard": 64},
        _plan(recompute="op"), A100_80GB, None, "reserved", "ran", TORCHTITAN_PERF),
    Run("Llama 3 70B, FSDP 64, local batch 1, full", _titan("llama3-70b"), {"dp_shard": 64},
        _plan(recompute="full"), A100_80GB, None, "reserved", "ran", TORCHTITAN_PERF),
]  # fmt: skip


def predict(run: Run) -> tuple[float, float, bool]:
    """``(allocated GiB, comparable GiB, fits)``: the cost model's peak, the figure comparable
    with the report's (× ``RESERVED_OVERHEAD`` for reserved figures), and the fit verdict on
    the device."""
    peak = peak_memory(run.model, Layout(**run.sizes), run.plan)
    overhead = RESERVED_OVERHEAD if run.kind == "reserved" else 1.0
    verdict = fit(peak, run.capacity * GiB, overhead)
    return peak.total / GiB, peak.total * overhead / GiB, verdict.fits


def markdown() -> str:
    """The table ``docs/cost.md`` shows (one row per run)."""
    lines = [
        "| run | layout | measured | predicted (allocated) | predicted × overhead | verdict | source |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for run in RUNS:
        allocated, comparable, fits = predict(run)
        layout = " × ".join(f"{k} {v}" for k, v in run.sizes.items() if v > 1) or "1 rank"
        measured = (
            f"{run.measured:.1f} GiB {run.kind}"
            if run.measured is not None
            else ("ran" if run.outcome == "ran" else "out of memory")
        )
        notes = f" ({run.notes})" if run.notes else ""
        verdict = f"{'fits' if fits else 'OOM'} {run.capacity:g} GiB"
        lines.append(
            f"| {run.label}{notes} | {layout} | {measured} | {allocated:.1f} GiB | {comparable:.1f} GiB | {verdict} "
            f"| [report]({run.source}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
