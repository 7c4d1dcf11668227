"""The `energy` command (and `python -m energydsl`).

The CLI's imports take a fraction of a second; a Ctrl-C that arrives then would print Python's
KeyboardInterrupt traceback, so this entry point imports the CLI under the same rule as its commands:
Ctrl-C prints `interrupted` and exits 130. Its SIGINT handler (`signal_handlers.CtrlC`) holds a Ctrl-C back
while another package is imported, where torch would lose it.
"""

from __future__ import annotations

import sys

from .signal_handlers import install_ctrl_c


def main() -> None:
    install_ctrl_c()
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    cli_main()


if __name__ == "__main__":
    main()
