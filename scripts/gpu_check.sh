#!/usr/bin/env bash
# One pass of the GPU checks on a CUDA machine: the GPU test module, the CUDA codec unit tests, the
# doctor tests, and the codecs and allreduce benchmarks (tables in benchmarks/results-gpu, which
# `python -m benchmarks report` adds to RESULTS.md; copies and the test log under $OUT when set).
# Wheels of packages the machine lacks may be placed in .whl/ beforehand (it may have no package index).
set -uo pipefail
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled OMP_NUM_THREADS=1
res=benchmarks/results-gpu; mkdir -p "$res"
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl || exit 3; fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation . || exit 4
nvidia-smi -L
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
t0=$SECONDS
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/cli/test_doctor.py \
  tests/unit/test_codecs.py::test_rounding_noise_and_quantized_codes_agree_on_cuda \
  tests/unit/test_codecs.py::test_topk_and_sign_messages_on_cuda_equal_the_cpu_ones 2>&1 | tee "$res/test-gpu.log"
echo "tests: $((SECONDS - t0)) s" | tee -a "$res/test-gpu.log"
timeout 120 python3 -m benchmarks codecs --out "$res" 2>&1 | tail -20
timeout 120 python3 -m benchmarks allreduce --out "$res" 2>&1 | tail -16
rm -f "$res"/*.png
if [ -n "${OUT:-}" ]; then cp "$res"/* "$OUT"/; fi
