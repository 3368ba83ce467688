"""The ``draftgraph`` command line: one subcommand per tool, each with --help and examples."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module (each module has add_parser(subparsers) and run(args) -> int)
COMMANDS = {
    "demo": "draftgraph.tools.demo",
    "draft": "draftgraph.tools.draft",
    "dump": "draftgraph.tools.dump",
    "draw": "draftgraph.tools.draw",
    "arena": "draftgraph.tools.arena",
    "plan-csv": "draftgraph.tools.plan_csv",
    "capture-dump": "draftgraph.tools.capture_dump",
    "decode": "draftgraph.tools.decode",
    "swap": "draftgraph.tools.swap",
}


class UsageError(Exception):
    """A bad argument: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftgraph",
        description="Graph runtime with CUDA Graph capture for the DeepSeek-V4 MTP draft step.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # a tool not shipped in this build
            raise
        module.add_parser(sub)
        sub.choices[name].set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from draftgraph.runtime.errors import DraftGraphError

    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"draftgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except DraftGraphError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"draftgraph {args.command}: {type(exc).__name__}: {first}", file=sys.stderr)
        return 2
    except OSError as exc:
        # The system refused what the checks let through (a write to a full disk or to a file
        # system that takes no new file, an input path it cannot look up): its reason on one
        # line, as cp or tee print it; exit 1, not 2: the argument may be sound.
        print(f"draftgraph {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # Under `python -m draftgraph.tools.cli` this file runs as __main__; the tools raise
    # draftgraph.tools.cli.UsageError,
    # so dispatch through the imported module for its exception classes to be the ones caught.
    from draftgraph.tools.cli import main as package_main

    sys.exit(package_main())
