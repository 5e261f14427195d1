#!/usr/bin/env bash
# One prepared accelerator run (at most 8 minutes on one H200) of the checks the CPU suite cannot make.
#   scripts/gpu_check.sh [OUT_JSON] [extra args for scripts/gpu_check.py, e.g. --allow-cpu, --sections ...]
#
# Needs python3 + torch with CUDA.  megatron-core (offload, gpt_step, tiled_replay, fused_replay, residual_grad,
# max_seq sections) may be absent: wheels in <repo>/.whl/ are installed into /tmp/longctx-site first when
# megatron.core does not import.
#
# The device machine (torch 2.11 + CUDA 13, Python 3.12, no megatron-core; flash-attn and Transformer
# Engine absent, so sdpa_cuda is the backend proven there).  Once, here, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.19.2
# (its requirements torch, numpy, packaging are on the image).  Then the one device `run` call:
#   command:   set -o pipefail; scripts/gpu_check.sh $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log
#   carry:     [".whl"]
#   timeout_s: 560   (440 s of section budgets inside the 480 s limit below, the wheel install and the start;
#                     leaves a rerun inside 15 minutes of device time)
# It prints one table (a row per section) and writes the JSON; every section must come back "ok".
# Exit status: 0 every section ok; 1 any section failed, errored, incomplete (time budget) or unavailable;
# 3 no CUDA device, 4 GPUs present but unusable by torch, 124 the 8-minute limit.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-gpu_check.json}"
shift || true
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
if ! "${PYTHON}" -c "import megatron.core" 2>/dev/null && compgen -G "${here}/.whl/*.whl" >/dev/null; then
    site=/tmp/longctx-site
    "${PYTHON}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${site}" \
        "${here}"/.whl/*.whl || { echo "gpu_check: installing the carried wheels failed" >&2; exit 1; }
    export PYTHONPATH="${PYTHONPATH}:${site}"
fi
# Fewer, larger allocator segments: the max_seq search measures what fits, not fragmentation.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
timeout --signal=TERM --kill-after=20 480 "${PYTHON}" "${here}/scripts/gpu_check.py" --out "${out}" "$@"
rc=$?
if [ "${rc}" -eq 124 ]; then
    echo "gpu_check: stopped at the 8-minute limit; ${out} holds the sections that finished" >&2
fi
exit "${rc}"
