"""The ``jaxserve`` command, shaped like vLLM's: ``jaxserve serve MODEL [options]`` (the same options as
``python -m jaxserve.serve``, the model given by position) and ``jaxserve generate [options]``."""

from __future__ import annotations

import sys

USAGE = """usage: jaxserve serve [MODEL] [options]     serve MODEL over HTTP (OpenAI-compatible) and gRPC
       jaxserve generate [options]          generate offline (python -m jaxserve.generate)

'jaxserve serve --help' lists every option."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        if rest and not rest[0].startswith("-"):
            rest = ["--model", rest[0], *rest[1:]]
        from jaxserve.serve import main as serve_main

        return serve_main(rest, prog="jaxserve serve")
    if command == "generate":
        from jaxserve.generate import main as generate_main

        return generate_main(rest) or 0
    print(f"jaxserve: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
