"""The `energy` command (and `python -m energydsl`).

The CLI's imports take a fraction of a second; a Ctrl-C that arrives then would print Python's
KeyboardInterrupt traceback, so this entry point imports the CLI under the same rule as its commands:
Ctrl-C prints `interrupted` and exits 130.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    cli_main()


if __name__ == "__main__":
    main()
