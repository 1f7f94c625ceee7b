"""Images grouped by what they show (a plan's `image_groups`): the test images the intervals resample and the labelled
pool the dev split and folds divide; each image's group, read from its key."""

from __future__ import annotations

import re
from collections.abc import Iterable

from mpp.errors import UserError


class GroupKeyError(UserError):
    """An image's key that the plan's image_groups pattern does not name a group in."""


def key_groups(pattern: str | None, keys: Iterable[str]) -> list[str] | None:
    """Each key's group: the first capture group of `pattern` searched in the key; None without a pattern (every
    image its own group). A key it does not match is refused in one line naming the key and the field."""
    if pattern is None:
        return None
    regex, groups = re.compile(pattern), []
    for key in keys:
        match = regex.search(key)
        if match is None or not match.group(1):
            raise GroupKeyError(f"image {key} does not match image_groups {pattern!r}, whose first capture group "
                                 f"must name what the image shows; fix the pattern or set image_groups: null")
        groups.append(match.group(1))
    return groups
