"""Errors a user can cause (bad config, missing files, unusable data or checkpoints).

Anything raised as a ``UserError`` is reported by the entry points as one line on stderr
with exit status 2, never as a traceback: the message must name the offending key, file
or value and, where possible, what would be valid.
"""


class UserError(Exception):
    """A problem with the user's input that they can fix; the message is shown as is."""


EXIT_USER_ERROR = 2
