"""`python -m stoker.cli`: the `stoker` command."""

from . import main

raise SystemExit(main())
