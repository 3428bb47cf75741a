"""The ``jaxserve`` command, shaped like vLLM's ``vllm``: ``jaxserve COMMAND [options]``.

``jaxserve serve MODEL [options]`` takes the same options as ``python -m jaxserve.serve`` (which takes the model
by position too); ``generate``, ``aot``, ``plan`` and ``capacity`` run ``python -m jaxserve.<command>`` with the same
options. ``jaxserve COMMAND --help`` lists a command's options.

Each command's module is imported only when that command runs, so ``jaxserve --help`` loads no jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: its one-line description and the module and function that run it, as
    ``function(argv, prog=...)``."""

    summary: str
    module: str
    function: str


COMMANDS = {
    "serve": Command("serve a model over an OpenAI-compatible HTTP API and gRPC", "jaxserve.serve", "main"),
    "generate": Command("generate text offline for prompts given on the command line", "jaxserve.generate", "main"),
    "aot": Command("compile the serving steps ahead of time for TPU topologies", "jaxserve.tools.aot", "cli"),
    "plan": Command("simulate deployments and find the rates that meet the SLOs", "jaxserve.tools.plan.cli", "main"),
    "capacity": Command("the KV pages, sequences and context that fit on a device", "jaxserve.tools.capacity",
                        "main"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser, for its help only: each command parses its own options."""
    p = argparse.ArgumentParser(prog="jaxserve", description="jaxserve: an LLM inference engine in JAX.",
                                epilog="'jaxserve COMMAND --help' lists a command's options.")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.summary, add_help=False)
    return p


def run_command(name: str, argv: list[str]) -> int:
    """Runs subcommand ``name`` with its options ``argv``; returns the exit code."""
    command, prog = COMMANDS[name], f"jaxserve {name}"
    entry: Callable[..., int | None] = getattr(importlib.import_module(command.module), command.function)
    return entry(argv, prog=prog) or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"jaxserve: error: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    return run_command(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
