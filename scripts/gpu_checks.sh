#!/usr/bin/env bash
# The CUDA checks, for a lent GPU machine (the `device` tool runs this from the repository root):
# the CUDA tests (CI has no GPU: they skip there), then the FP8/FP4 product timings and the FP8
# simulation-against-kernel check (scripts/gpu_scaled_mm.py), then speculative decoding's costs for
# the Qwen2.5-Coder-1.5B target and draft (scripts/gpu_draft_cost.py). Results go to $OUT (or ./gpu-out).
# The machine's image has torch, transformers, onnx(runtime), pytest; the rest of compress's imports
# travel as wheels in .whl/ (see the device tool's README):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 gguf==0.19.0
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
tests=0
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: the measurements alone
  python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers" -k cuda \
    tests/test_calibrated.py tests/test_llm_int8.py tests/test_calibration_checks.py tests/test_memory.py \
    tests/test_fp8.py tests/test_w8a8.py "$@" 2>&1 | tee "$OUT/tests.log"
  tests=${PIPESTATUS[0]}
fi
python3 scripts/gpu_scaled_mm.py --json "$OUT/scaled_mm.json" > "$OUT/scaled_mm.log" 2>&1; mm=$?
tail -4 "$OUT/scaled_mm.log"
python3 scripts/gpu_draft_cost.py --json "$OUT/draft_cost.json" > "$OUT/draft_cost.log" 2>&1; draft=$?
tail -25 "$OUT/draft_cost.log"
echo "tests $tests, scaled_mm $mm, draft_cost $draft"
exit $(( tests || mm || draft ))
