"""`python -m stoker`: the `stoker` command."""

from .cli.main import main

raise SystemExit(main())
