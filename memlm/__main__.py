"""`python -m memlm` runs the same command line as the `memlm` console script."""

from memlm.cli import main

raise SystemExit(main())
