#!/usr/bin/env bash
# One prepared accelerator run (at most 8 minutes) of the checks the CPU suite cannot make.
# Needs only python + torch; megatron-core (for the max_seq section) may be absent or carried as a wheel.
#   scripts/gpu_check.sh [OUT_JSON] [extra args for scripts/gpu_check.py, e.g. --allow-cpu]
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-gpu_check.json}"
shift || true
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
# Fewer, larger allocator segments: the max_seq search measures what fits, not fragmentation.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
PYTHON="${PYTHON:-python3}"
timeout --signal=TERM --kill-after=20 480 "${PYTHON}" "${here}/scripts/gpu_check.py" --out "${out}" "$@"
rc=$?
if [ "${rc}" -eq 124 ]; then
    echo "gpu_check: stopped at the 8-minute limit; ${out} holds the sections that finished" >&2
fi
exit "${rc}"
