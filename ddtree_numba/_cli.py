"""The command lines' argparse: every error on one line, ``PROG: error: ...``, exit status 2.

Standard library only, so that a tool can load this file by its path without importing the
package (``tools/kernel_diff.py`` does: its package on ``sys.path`` is the one it compares).
"""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse, with each error on one line (no usage block): ``PROG: error: --opt: ...``."""

    def error(self, message):
        message = message.removeprefix("argument ")
        self.exit(2, f"{self.prog}: error: {message}\n")
