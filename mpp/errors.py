"""Errors that are the user's to fix: the CLI prints their one-line message, without a traceback."""


class UserError(Exception):
    """A mistake in a config, a path or the data; the message names the thing and the fix."""


class DataError(UserError):
    """A user-facing problem with the shard set; the message names it and the fix."""
