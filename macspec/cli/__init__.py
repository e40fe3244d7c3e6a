"""The `macspec` command. Each subcommand lives beside the code it drives and registers itself here.

Flags are the Python functions' keyword arguments (``--max-tokens`` is ``max_tokens=``), and this is
the one place where the project's errors become a message and an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..base import logs
from ..base.errors import MacspecError

# subcommand -> module that defines `register(subparsers)`; the parser it adds sets `func(args)`.
COMMANDS = {
    "generate": "macspec.cli.generate",
    "chat": "macspec.ui.command",
    "serve": "macspec.server.command",
    "check": "macspec.models.compat",
    "convert": "macspec.models.convert",
    "models": "macspec.models.catalog",
    "bench": "macspec.tools.bench.command",
    "doctor": "macspec.tools.doctor",
    "eval": "macspec.tools.evaluate",
    "distill": "macspec.tools.distill",
}


VERBOSE_HELP = "also show why each fallback was taken (the INFO log records)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="macspec", description="Exact speculative decoding for local LLMs on MLX."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in dict.fromkeys(COMMANDS.values()):
        importlib.import_module(module_name).register(sub)
    for command in sub.choices.values():  # `macspec chat -v` as well as `macspec -v chat`
        command.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logs.show(verbose=vars(args).pop("verbose"))  # consumed here: commands take their own flags
    try:
        result = args.func(args)
    except MacspecError as e:
        print(f"macspec: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("macspec: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
