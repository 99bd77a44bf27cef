#!/usr/bin/env bash
# One prepared GPU run (fits well inside 10 minutes on an H200): the no-sync test, then the
# overhead benchmark on the GPT-2-small workload. Writes results under $OUT (device tool) or ./.
set -uo pipefail
out=${OUT:-.}
export PYTHONUNBUFFERED=1
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/gpu_env.txt"
python3 -m pip install -q -e '.[dev]' --no-deps 2>/dev/null || true
python3 -m pytest -q tests/test_hot_path.py 2>&1 | tee "$out/gpu_tests.txt"
timeout 420 python3 benchmarks/overhead.py --device cuda --rounds 7 --steps 10 --warmup 3 --json "$out/gpu_overhead.json" 2>&1 | tee "$out/gpu_overhead.txt"
