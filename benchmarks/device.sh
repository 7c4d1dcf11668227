#!/usr/bin/env bash
# The GPU checks of the Triton kernels on a machine with CUDA, PyTorch and Triton but no network.
#
#   bash benchmarks/device.sh wheels                 # with network, once: the wheels that machine lacks -> .whl/
#   bash benchmarks/device.sh run tests [-n 12]      # on the GPU machine (the repository and .whl/ copied there)
#   bash benchmarks/device.sh run kernels [--quick]  #   benchmarks/kernels.py, JSON and log to $OUT
#   bash benchmarks/device.sh run modules [--seq 2048,8192]
#   bash benchmarks/device.sh run profile [--families attention,layers]   # profile_kernels.py, traces to $OUT
#   bash benchmarks/device.sh run precision         # precision.py: errors against float64, GPU-compiled
#   bash benchmarks/device.sh run all               # one call for a short lease: each step under a time cap
#
# Such a machine (an image with torch, triton, sympy, numpy, einops and pytest, Python 3.12) lacks lark, which
# the compiler needs, flash-linear-attention's kernels (fla-core), the linear family's peer, rich (modules.py's
# table) and pytest-xdist. `wheels` fetches them as Python 3.12 wheels; `run` installs them under /tmp/site without touching the machine's
# environment, then runs one step, writing its log (and the benchmark's JSON, with device, versions, commit
# and date) to $OUT (default runs/device). Set ENERGYDSL_COMMIT to the commit sent: the copy's .git, if it has
# one, may be an older checkout's. Only the GPU-relevant test files are collected: the others import
# optuna and ray, which the image does not have.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(lark==1.3.1 fla-core==0.6.0 pytest-xdist==3.8.0 execnet==2.1.1 rich==15.0.0 markdown-it-py==4.0.0 mdurl==0.1.2)
GPU_TESTS=(tests/test_kernels_attention.py tests/test_kernels_linear.py tests/test_kernels_pointwise.py
           tests/test_kernels_epilogue.py tests/test_kernels_launch.py tests/test_triton_backend.py
           tests/test_triton_source.py tests/test_scalar_functions.py)

case "${1:-}" in
  wheels)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "${WHEELS[@]}"
    ls .whl
    ;;
  run)
    step="${2:-}"
    case "$step" in tests|kernels|modules|profile|precision|all) ;;
      *) echo "usage: $0 run tests|kernels|modules|profile|precision|all [args...]" >&2; exit 2 ;; esac
    shift 2
    out="${OUT:-runs/device}"
    mkdir -p "$out"
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
    fi
    export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
    unset TRITON_INTERPRET
    # precision.py: the second moment and first-order attention at the interpreter's shape, then a longer one
    precision='python3 benchmarks/precision.py && python3 benchmarks/precision.py --op attention &&
               python3 benchmarks/precision.py --shape 2,4,1024,64'
    python3 -c "import sys, torch; sys.exit(print(torch.cuda.get_device_name()) if torch.cuda.is_available()
                else 'no CUDA device: this step is for the GPU machine')"
    case "$step" in
      tests)
        # the gpu-marked tests, then the same files' CPU-sized tests compiled for this GPU
        python3 -m pytest -v -p no:cacheprovider -m gpu "${GPU_TESTS[@]}" "$@" 2>&1 | tee "$out/tests-gpu.log"
        python3 -m pytest -v -p no:cacheprovider -m "not slow and not gpu" "${GPU_TESTS[@]}" "$@" 2>&1 | tee "$out/tests.log"
        ;;
      kernels) python3 benchmarks/kernels.py --json "$out/kernels.json" "$@" 2>&1 | tee "$out/kernels.log" ;;
      modules) python3 benchmarks/modules.py --json "$out/modules.json" "$@" 2>&1 | tee "$out/modules.log" ;;
      profile) python3 benchmarks/profile_kernels.py --trace "$out/traces" "$@" 2>&1 | tee "$out/profile.log" ;;
      precision) bash -c "$precision" 2>&1 | tee "$out/precision.log" ;;
      all)
        # every step in one call, each stopped at its cap (seconds; ALL_CAPS="kernels modules profile precision
        # tests" overrides), the next one run whatever the last did: 530 s in all, under a 600 s call. The benchmarks
        # run first, alone on the GPU, the families no GPU has timed yet first (the H200 run of 2026-11-30
        # timed 6 attention cases in 180 s, autotuning included, and 3 layers in 125 s); then the gpu-marked
        # tests beside the CPU-sized tests of the paths changed since the last GPU run (large scores,
        # per-sample gradients, TorchScript, pointwise, ALiBi). Tests print one line each (-v), so a log cut
        # at its cap still names every result. A stopped step's log (and a benchmark's rows so far) stays in
        # $OUT.
        read -r cap_kernels cap_modules cap_profile cap_precision cap_tests <<< "${ALL_CAPS:-200 100 45 25 160}"
        capped() {  # capped SECONDS LOG COMMAND...: run, log, and say how it ended
          local seconds=$1 log=$2 rc=0
          shift 2
          timeout --signal=INT --kill-after=10 "$seconds" "$@" > "$out/$log" 2>&1 || rc=$?
          tail -n 25 "$out/$log"
          echo "== $log: exit $rc$( [ "$rc" = 124 ] && echo " (stopped at its cap, ${seconds} s)")" | tee -a "$out/all.log"
        }
        capped "$cap_kernels" kernels.log python3 benchmarks/kernels.py --targets --json "$out/kernels.json" \
          --families linear,pointwise,attention-wide,attention,epilogue
        # (modules.py prints each row as JSON in its log: no modules.json, as $OUT brings back 8 files at most)
        capped "$cap_modules" modules.log python3 benchmarks/modules.py --seq 2048,8192
        # the softmax fwd+bwd at T = 1k and 8k split into wall, GPU and host time: the fixed cost at short T
        capped "$cap_profile" profile.log python3 benchmarks/profile_kernels.py --families attention
        capped "$cap_precision" precision.log bash -c "$precision"
        workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8)
        capped "$cap_tests" tests-selected.log python3 -m pytest -v -p no:cacheprovider "${workers[@]}" \
          -m "not slow and not gpu" -k "large_scores or per_sample or torchscript or row_bias or alibi or pointwise" \
          "${GPU_TESTS[@]}" &
        capped "$cap_tests" tests-gpu.log python3 -m pytest -v -p no:cacheprovider "${workers[@]}" -m gpu \
          "${GPU_TESTS[@]}" "$@"
        wait
        ;;
    esac
    ;;
  *)
    echo "usage: $0 wheels | run tests|kernels|modules|profile|precision|all [args...]" >&2
    exit 2
    ;;
esac
