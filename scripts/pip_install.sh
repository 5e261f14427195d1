#!/usr/bin/env bash
# `pip install --quiet ARGS...` into the virtual environment VENV, robust to a flaky network: a download cut
# short is resumed up to 20 times, and a failed install is tried again twice, 30 s apart.  What a failed try
# installed stays installed, so a retry fetches only what is missing.
# Usage: scripts/pip_install.sh VENV ARGS...
set -uo pipefail
venv=$1
shift
export PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-20}
for attempt in 1 2 3; do
    "$venv/bin/pip" install --quiet "$@" && exit 0
    status=$?
    [ "$attempt" = 3 ] && break
    echo "pip install failed (exit $status, attempt $attempt of 3); trying again in 30 s" >&2
    sleep 30
done
echo "pip install $* failed 3 times: check the network or the package index, then run make again" >&2
exit "$status"
