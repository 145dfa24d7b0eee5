"""`python -m basert` runs the `basert` command."""

import sys

from basert.cli.main import main

sys.exit(main())
