"""`python -m stoker.cli`: the `stoker` command."""

from .main import main

raise SystemExit(main())
