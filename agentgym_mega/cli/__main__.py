"""`python -m agentgym_mega.cli`: what servers, sweeps and tests start as a subprocess."""

import sys

from agentgym_mega.cli import main

sys.exit(main())
