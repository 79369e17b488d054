"""``tandem bench steps LOG``: where a served engine's step time went, from the log that
``TANDEM_STEP_LOG`` makes it write (engine/step_log.py)."""

from __future__ import annotations


def run_steps(args) -> int:
    from engine.step_log import report

    print(report(args.log, args.bucket, args.parts))
    return 0


def register(commands, default_model: str) -> None:
    steps = commands.add_parser("steps", help="summarise a TANDEM_STEP_LOG file: step time by batch, "
                                              "prompt tokens and the prefill lane")
    steps.add_argument("log", help="a file written under TANDEM_STEP_LOG=PATH (PATH's {pid} filled in)")
    steps.add_argument("--bucket", type=int, default=10, help="decodes per row of the table")
    steps.add_argument("--parts", type=int, default=1,
                       help="also table the decode-only steps of this many consecutive shares of the log "
                            "(how a worker's steps and KV layout changed as it served)")
    steps.set_defaults(func=run_steps)
