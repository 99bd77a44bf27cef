#!/usr/bin/env bash
# One prepared GPU run (about 5 minutes on an H200 machine of the device tool): installs
# nummon and the carried wheels (pydantic is not in that image), runs the CUDA no-sync test and
# the CPU suites under that image's torch, the demo on CPU and CUDA, then the GPT-2-small
# overhead benchmark with the statistics-pass bandwidth and the hook-reduction probe (which
# reduction the activation hooks should use on this device). Results land under $OUT.
set -uo pipefail
out=${OUT:-/tmp/gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_SILENT=true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/nm . >/dev/null 2>&1 || { echo "nummon install failed"; exit 1; }
export PYTHONPATH=/tmp/nm:/tmp/site
repo=$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  (cd /tmp && python3 -c "import torch, nummon; print('torch', torch.__version__, torch.cuda.get_device_name(0), nummon.__file__)"); } 2>&1 | tee "$out/gpu_env.txt"
(cd tests && timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-stats/test_hot_path.py stats/test_stats_collector.py stats/test_stats_preclip.py monitor/test_monitor.py engine/test_detectors.py tools/test_diagnose.py monitor/test_distributed.py} 2>&1 | tail -15) | tee "$out/gpu_tests.txt"
for dev in cpu cuda; do  # from /tmp: the checkout's nummon/ must not shadow the installed package
  (cd /tmp && timeout 90 python3 -m nummon demo --device $dev --no-wandb --no-tensorboard --out /tmp/demo_$dev 2>&1 | grep -E "warned|no warning|first NaN|\(.* s;|error") | tee -a "$out/gpu_demo.txt"
done
timeout 300 python3 benchmarks/overhead.py --device cuda --rounds 7 --steps 10 --warmup 3 --json "$out/gpu_overhead.json" 2>&1 | grep -v Warning | tail -20 | tee "$out/gpu_overhead.txt"
# the cost-scale benchmark (issue 26): 20 to 2,000 tiny tensors, a 12-block LM, the demo CNN and
# GPT-2-small's shape with 12 and 48 blocks in bf16, monitored vs bare with an A/A control
timeout ${SCALE_TIMEOUT:-240} python3 benchmarks/overhead_scale.py --device cuda --rounds ${SCALE_ROUNDS:-5} \
  --workloads tiny-20,tiny-1000,tiny-2000,lm12,cnn,gpt12,gpt48 --json "$out/gpu_overhead_scale.json" 2>&1 | grep -v Warning | tee "$out/gpu_overhead_scale.txt"
