"""`python -m tts_cli` and the `tts` command (pyproject's entry point)."""
import sys

from . import INTERRUPTED_EXIT


def main() -> None:
    """The CLI, with a Ctrl-C while its modules import (about 0.1 s, before typer handles Ctrl-C) ending as
    one later does: exit 130 and one line, not a traceback."""
    try:
        from .cli import app
        app(prog_name="tts")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)


if __name__ == "__main__":
    main()
