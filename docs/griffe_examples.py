"""griffe extension: a docstring's ``Example:`` section renders as code, as ``Examples:`` does.

stoker's docstrings head their doctests ``Example:`` (Google style allows both); griffe treats
only ``Examples:`` as an examples section, and would render the ``>>>`` lines as Markdown prose.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
