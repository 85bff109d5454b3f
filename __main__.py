"""`python -m radixlm`: the `radixlm` command."""

from __future__ import annotations

import sys

from radixlm.cli import main

if __name__ == "__main__":
    sys.exit(main())
