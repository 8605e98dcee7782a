"""`python -m bitserve ...` runs the `bitserve` command line."""

from bitserve.cli.main import main

raise SystemExit(main())
