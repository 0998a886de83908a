#!/usr/bin/env bash
# The GPU check of the training step, the plan and decoding, in one command on a FRESH GPU machine (one H200 as
# the device tool lends it: Python 3.12, torch with CUDA, no network, no deepspeed): under 10 minutes, every stage
# with its own time limit (bench/gpu_check.py BUDGET), ONE JSON ($OUT/gpu_check.json) and the logs
# ($OUT/gpu_check.log), each stage's result or its failure recorded; a summary table is printed last.
#
# Stages (paper scale: d 2048, J x L 3 x 8, vocab 50,304, context 2048, bf16, micro-batch 6); every execution
# strategy of t-loopformer (model.execution compact, sorted, bucketed, dense) runs side by side, loopformer beside;
# the script chooses nothing (the JSON's summary.strategies and bench/README do):
#   setup         carried wheels into /tmp/site; tlf prep-data of 1M tokens of the demo corpus (.gpu/demo.jsonl)
#   tests         the CUDA cases of the invariant tests for every strategy (each strategy = the dense reference in
#                 losses and gradients, cached decode = forward, the determinism contract) and tests/test_mfu.py
#                 (junit counts in the JSON)
#   train_step    bench/train_step.py loopformer and t-loopformer under each strategy side by side: per strategy
#                 tokens/s, MFU, peak GiB, time / FLOPs vs loopformer (summary.strategies.NAME)
#   plan_check    bench/plan_check.py: tlf train's planned vs measured peak and MFU, t-loopformer without and with
#                 activation_checkpointing=loop (8 steps each)
#   step_profile  bench/step_profile.py loopformer and t-loopformer under each strategy: per loop matmul /
#                 attention / gather-sort-scatter time, kernels, small kernels, syncs
#   decode        bench/decode.py: TTFT (batch 1, 32) and TPOT (batch 1, 32) of t-loopformer vs loopformer, the
#                 full-depth cache, no cache and the dense base; TPOT against the memory-bandwidth floor
#
# Before the device is used (here, in the repository root of the checkout the device tool sends; once, ~1 min):
#   bash bench/gpu_wheels.sh          # writes the git-ignored .gpu/ (wheels, BPE files, demo corpus; ~20 MB)
# The device tool's call (the whole command; .gpu travels as a carried path):
#   run(command="bash bench/gpu_check.sh", carry=[".gpu"], timeout_s=600)
# A rerun of some stages only (what is left of the 15 device minutes allows ~4 more):
#   run(command="bash bench/gpu_check.sh --stages setup,decode", carry=[".gpu"], timeout_s=300)  # plan_check needs setup
#
# Dry run on a CPU machine (the same stages at tiny scale, fp32; a few minutes; no wheels needed):
#   PYTHON=.venv/bin/python OUT=/tmp/gpu_check_dry bash bench/gpu_check.sh --dry-run
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DS_BUILD_OPS=0 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
if [ -d .gpu/tiktoken ]; then
  export TIKTOKEN_CACHE_DIR="$PWD/.gpu/tiktoken"
fi
case " $* " in
  *" --dry-run "*) ;;
  *)
    if ! ls .gpu/wheels/*.whl >/dev/null 2>&1; then
      echo "no wheels in .gpu/wheels: run bash bench/gpu_wheels.sh here first and carry .gpu" >&2
    else
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/wheels/*.whl 2>&1 | tail -3
      export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    export TLF_CACHE=${TLF_CACHE:-/tmp/tlf_cache}
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tail -2
    ;;
esac
exec "$PY" bench/gpu_check.py --out "$OUT" --python "$PY" "$@"
