"""What tests share: data (an independent generator and reader), resources (threads, files, maps a
test holds), and the scripts tests run as child processes by path (HELPERS / "name.py").

Kept free of imports beyond pathlib, so a benchmark or a child can import one module of it cheaply.
"""

from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[1]
