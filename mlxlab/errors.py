"""The one exception the command line reports as one line on stderr and exit code 1."""


class UserError(Exception):
    """A problem with what the user asked for: reported as one line, exit code 1."""
