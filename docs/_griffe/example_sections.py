"""Griffe extension for the API reference: read ``Example:`` as an examples section.

The package's docstrings head their doctest snippets with ``Example:`` (singular).
Griffe's Google parser knows only ``Examples:`` and would render ``Example:`` as an
admonition whose ``>>>`` lines become nested block quotes; this renames the header
so the snippets render as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` section headers to ``Examples:``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
