#!/usr/bin/env bash
# Writes .gpu/ (git-ignored), what bench/gpu_check.sh needs on a GPU machine that has no network and no deepspeed:
#   .gpu/wheels/     deepspeed 0.19.8 as a py3 wheel built here (DS_BUILD_OPS=0: no compiled ops; PyPI has only
#                    its sdist) and what it needs that the device image lacks: hjson, pydantic, pydantic-core
#                    (CPython 3.12, manylinux x86-64), annotated-types, typing-inspection and typing-extensions 4.16
#                    (pydantic needs >= 4.16; a newer one serves every older user). The image has torch, numpy,
#                    packaging, psutil, py-cpuinfo, msgpack, einops, ninja, tqdm, nvidia-ml-py, tiktoken, pyarrow,
#                    click, PyYAML and pytest (/work/.library/device/KINDS.md); tlf needs no mlflow, zstandard,
#                    datasets or lm-eval for these checks (logging.mlflow=false, local shards).
#   .gpu/tiktoken/   the GPT-2 BPE files under tiktoken's cache names (prep-data's tokenizer, offline)
#   .gpu/demo.jsonl  the demo corpus (State of the Union + Moby-Dick), prep-data's input
# Run it in the repository root of the checkout whose tree the device tool sends (~1 min, ~20 MB):
#   bash bench/gpu_wheels.sh            # PYTHON=... to pick the interpreter whose pip and torch build the wheel
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export DS_BUILD_OPS=0 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
rm -rf .gpu/wheels
mkdir -p .gpu/wheels
# DeepSpeed's setup imports torch: build without isolation, with this interpreter's torch
"$PY" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .gpu/wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/wheels hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
"$PY" - <<'EOF'
import shutil
from pathlib import Path

from data_prep.assets import ensure_assets, ensure_bpe

shutil.copyfile(ensure_assets()["demo"], ".gpu/demo.jsonl")
ensure_bpe(Path(".gpu/tiktoken"))
EOF
ls -l .gpu/wheels
du -sh .gpu
