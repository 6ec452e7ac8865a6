"""`python -m workers.emulated ...`: one emulated vLLM server (workers/emulated/cli.py)."""

from workers.emulated.cli import main

main()
