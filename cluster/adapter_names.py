"""What an adapter name may be: the name clients put in `model`, registered by a load call or the config.

One or two segments ("sql-v2", or Hugging Face's "org/name"), each starting
with a letter or digit and made of letters, digits, '.', '_', '-' and ':',
with no '..' anywhere: a name is also a path segment under
dynamic_lora_loading_path and a key in the registry file, so nothing in it may
climb out of where it is put. docs/api.md gives the same rule.
"""

from __future__ import annotations

import re

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._:-]*"
ADAPTER_NAME = re.compile(rf"{_SEGMENT}(/{_SEGMENT})?")
MAX_NAME_LENGTH = 200
# What dynamic loading appends to its path: one segment ("org/name" would be a directory below it).
DYNAMIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")

RULE = ("1-200 characters: one or two '/'-separated segments, each starting with a letter or digit, of letters, "
        "digits, '.', '_', '-' and ':', with no '..'")


def adapter_name_problem(name: object) -> str | None:
    """Why name cannot be an adapter's name, or None where it can."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_LENGTH:
        return f"must be {RULE}"
    if not ADAPTER_NAME.fullmatch(name) or ".." in name:
        return f"{name!r} is not an adapter name: {RULE}"
    return None
