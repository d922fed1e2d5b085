"""``python3 -m turboquant.integration.vllm verify ...``: the command line of cli.py."""
import sys

from .cli import main

sys.exit(main())
