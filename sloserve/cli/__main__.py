"""`python -m sloserve.cli ...`: the `sloserve` command."""
from __future__ import annotations

import sys

from sloserve.cli import main

sys.exit(main())
