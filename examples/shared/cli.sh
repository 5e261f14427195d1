# Sourced by the CPU examples: from the repository root, `run` is the command line of `megatron-longctx`
# (the installed entry point, else `python3 -m megatron_longctx` with $PYTHON when set).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if command -v megatron-longctx >/dev/null 2>&1; then
    run=(megatron-longctx)
else
    run=("${PYTHON:-python3}" -m megatron_longctx)
fi
