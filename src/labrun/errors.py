"""The one exception type for mistakes a user can fix: a config key, a file, an argument.

The message is one line that names the problem and the fix; entries print it and exit 2.
"""


class LabrunError(Exception):
    """A user-fixable problem; str(error) is the one line to print."""


class ConfigError(LabrunError):
    """A config value that cannot work; the message names the key and the fix."""


class DataError(LabrunError):
    """A data file or folder that cannot be read; the message names the file and the fix."""
