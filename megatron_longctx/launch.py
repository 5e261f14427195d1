"""``python -m megatron_longctx.launch <script.py> [args...]``: see :mod:`megatron_longctx.megatron.launch`."""
from megatron_longctx.megatron.launch import main

if __name__ == "__main__":
    main()
