import sys

from megatron_longctx.cli import main

sys.exit(main())
