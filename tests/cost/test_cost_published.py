"""The memory accounting against published training runs (``tests/support/published_runs.py``):
every measured peak predicted within ``TOLERANCE``, no run that ran called out of memory and no
run that ran out of memory called a fit, and ``docs/cost.md`` showing the current predictions.
No processes: the cost model is numpy."""

from __future__ import annotations

from pathlib import Path

from ..support.published_runs import RUNS, TOLERANCE, markdown, predict

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cost.md"


def test_at_least_twelve_measured_runs_each_within_the_tolerance():
    measured = [r for r in RUNS if r.measured is not None]
    assert len(measured) >= 12
    off = []
    for run in measured:
        _, comparable, _ = predict(run)
        if abs(comparable - run.measured) > TOLERANCE * run.measured:
            off.append(f"{run.label}: predicted {comparable:.1f} GiB, measured {run.measured} GiB")
    assert not off, "\n".join(off)


def test_no_oom_verdict_on_a_run_that_ran_and_no_fit_on_one_that_did_not():
    wrong = []
    for run in RUNS:
        _, _, fits = predict(run)
        if fits != (run.outcome == "ran"):
            wrong.append(f"{run.label}: {'fits' if fits else 'OOM'} but it {run.outcome}")
    assert {r.outcome for r in RUNS} == {"ran", "oom"} and not wrong, "\n".join(wrong)


def test_the_docs_show_the_current_predictions():
    text = DOCS.read_text()
    start, end = "<!-- published-runs -->", "<!-- /published-runs -->"
    assert start in text and end in text, f"docs/cost.md has no {start} ... {end} block"
    shown = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert shown == markdown(), (
        "docs/cost.md's table is stale: print the new one with python -m tests.support.published_runs"
    )
