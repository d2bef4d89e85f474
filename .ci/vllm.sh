#!/usr/bin/env bash
# The real-engine tests (docs/engines.md): vLLM's CPU build in a venv of its own (.venv-vllm, made
# by .ci/vllm_venv.sh; it pins torch==2.13.0+cpu), then tests/engines/test_engines_*.py in it. Called from
# .ci/run; works from a clean checkout. Measured in CI on the 2-core machine (2026-12-04): the
# venv 142 s, made beside the main suite; the tests (seven engine lives: Llama, Qwen2, Qwen3, a bf16
# engine, Gemma, Qwen3-MoE, DeepSeek-V3; expert parallel skipped) 478 s. Since issue 47 (measured
# on a shared, loaded machine, not in CI): the contract check of vLLM 0.32.0 and 0.34.0 ~20 s; the
# in-process Qwen2 worker-death life replaced by two `vllm serve` lives started at once (the serve
# test, ~4 min loaded); the newest vLLM's wheel fetched by .ci/vllm_venv.sh (~8 s). Since issue 50:
# the bf16 engine life became the delta + LoRA life (test_delta_and_lora_bf16: one engine with
# LoRA slots, delta syncs, an adapter, the merged adapter, refusals healed dense).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
start=$SECONDS
# the venv: made here, unless .ci/run already made it (in the background, beside the main suite)
if [ ! -f .venv-vllm/.meshgroups-ready ]; then
    bash .ci/vllm_venv.sh
fi
# two engine workers, one core each; a small KV cache
export VLLM_CPU_OMP_THREADS_BIND="0|1" VLLM_CPU_KVCACHE_SPACE=1
MESHGROUPS_TEST_TIME_SCALE="${MESHGROUPS_TEST_TIME_SCALE:-3}" .venv-vllm/bin/python -m pytest -q -s -p no:cacheprovider \
    tests/engines/test_engines_vllm_contract.py tests/engines/test_engines_worlds.py tests/engines/test_engines_destination.py \
    tests/engines/test_engines_vllm.py tests/engines/test_engines_vllm_serve.py
echo "+ .ci/vllm.sh done in $((SECONDS - start)) s"
