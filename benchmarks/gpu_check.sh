#!/usr/bin/env bash
# One prepared GPU run (about 6 minutes on an H200 machine of the device tool): installs nummon
# and the carried wheels (pydantic is not in that image), then, most wanted first:
#   gpt     the GPT-2-small overhead benchmark (every peer, the statistics pass against copy
#           bandwidth, the hook-reduction probe);
#   shapes  the host-cost bar's four shapes (MLP, 2- and 8-block LM, demo CNN) with the
#           per-parameter peer and the gradient-read floor;
#   tests   the CUDA no-sync test and the CPU suites under that image's torch;
#   demo    the demo on CPU and CUDA;
#   scale   the cost-scale benchmark.
# PARTS picks some ("gpt shapes" to split the run over two calls); DEVICE=cpu with PARTS=shapes
# (or gpt) dry-runs a part here. Results land under $OUT.
set -uo pipefail
out=${OUT:-/tmp/gpu_out}; mkdir -p "$out"
parts=" ${PARTS:-gpt shapes tests demo scale} "
dev=${DEVICE:-cuda}
want() { [[ $parts == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_SILENT=true
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
elif ! python3 -c "import pydantic" 2>/dev/null; then
  echo "no .whl/ wheels and no pydantic: carry them (benchmarks/RESULTS.md, 'What does it cost on a GPU?')"; exit 1
fi
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/nm . >/dev/null 2>&1 || { echo "nummon install failed"; exit 1; }
export PYTHONPATH=/tmp/nm:/tmp/site
{ [ "$dev" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  (cd /tmp && python3 -c "import torch, nummon; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA', nummon.__file__)"); } 2>&1 | tee "$out/gpu_env.txt"
if want gpt; then
  timeout ${GPT_TIMEOUT:-300} python3 benchmarks/overhead.py --device "$dev" --rounds ${GPT_ROUNDS:-7} --steps 10 --warmup 3 --json "$out/gpu_overhead.json" 2>&1 | grep -v Warning | tail -20 | tee "$out/gpu_overhead.txt"
fi
if want shapes; then  # nummon's added time against the peer's (the bar) and against reading the gradients alone
  for s in mlp lm2 lm8 cnn; do
    timeout ${SHAPE_TIMEOUT:-75} python3 benchmarks/overhead.py --device "$dev" --shape $s --rounds ${SHAPE_ROUNDS:-15} --steps 10 --warmup 3 \
      --only "nummon default,per-parameter .item(),gradient norms only" --json "$out/gpu_shape_$s.json" 2>&1 | grep -v Warning | tail -10 | tee -a "$out/gpu_shapes.txt"
  done
fi
if want tests; then
  (cd tests && timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-stats/test_hot_path.py stats/test_stats_collector.py stats/test_stats_preclip.py monitor/test_monitor.py engine/test_detectors.py tools/test_diagnose.py monitor/test_distributed.py} 2>&1 | tail -15) | tee "$out/gpu_tests.txt"
fi
if want demo; then
  for d in cpu cuda; do  # from /tmp: the checkout's nummon/ must not shadow the installed package
    (cd /tmp && timeout 90 python3 -m nummon demo --device $d --no-wandb --no-tensorboard --out /tmp/demo_$d 2>&1 | grep -E "warned|no warning|first NaN|\(.* s;|error") | tee -a "$out/gpu_demo.txt"
  done
fi
if want scale; then
  # the cost-scale benchmark (issue 26): 20 to 2,000 tiny tensors, a 12-block LM, the demo CNN and
  # GPT-2-small's shape with 12 and 48 blocks in bf16, monitored vs bare with an A/A control
  timeout ${SCALE_TIMEOUT:-240} python3 benchmarks/overhead_scale.py --device "$dev" --rounds ${SCALE_ROUNDS:-5} \
    --workloads tiny-20,tiny-1000,tiny-2000,lm12,cnn,gpt12,gpt48 --json "$out/gpu_overhead_scale.json" 2>&1 | grep -v Warning | tee "$out/gpu_overhead_scale.txt"
fi
