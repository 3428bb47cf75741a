"""Generate completions for a JSONL file of requests; resumable.

    python scripts/batch_generate.py --model M --input in.jsonl --output out.jsonl [engine options]

Input lines: {"id": ..., "prompt": "text" | [token ids]} or {"id": ..., "messages": [...]}, plus any
SamplingParams field (max_tokens, temperature, top_p, top_k, stop, seed, n, logprobs, ...). Output lines:
{"id", "text", "finish_reason", "token_ids", "usage"}, appended as each request finishes. Rerunning the same
command after a crash skips the ids already written. Malformed lines are reported with their line number.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.config.args import add_engine_args, engine_config_from_args  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.tools.batch_job import run_batch_job  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, required=True, help="JSONL file of requests")
    parser.add_argument("--output", type=Path, required=True, help="JSONL file results are appended to")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="requests queued in the engine at once (default: 4 x --max-num-seqs)")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if not args.input.exists():
        parser.error(f"--input {args.input} does not exist")
    engine = Engine(engine_config_from_args(args))
    summary = run_batch_job(engine, args.input, args.output, max_in_flight=args.max_in_flight)
    print(summary.report(), flush=True)


if __name__ == "__main__":
    main()
