#!/usr/bin/env bash
# The CUDA checks, for a lent GPU machine (the `device` tool runs this from the repository root).
# CI has no GPU: these tests skip there. The machine's image has torch, transformers, onnx(runtime), pytest;
# the rest of compress's imports travel as wheels in .whl/ (see the device tool's README):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 gguf==0.19.0
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" -k cuda \
  tests/test_calibrated.py tests/test_llm_int8.py tests/test_calibration_checks.py tests/test_memory.py "$@"
