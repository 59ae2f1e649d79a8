"""The ``shardwise`` command: ``run`` (launcher), ``report`` (environment), ``estimate``
(memory), ``convert`` (checkpoint consolidation) and ``serve`` (an OpenAI-compatible server)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "run": "start a training script on every rank",
        "report": "print versions, devices and which optional features are usable",
        "estimate": "model-state memory per device for ZeRO stages 0-3, with and without offload",
        "convert": "write one full state-dict file from any shardwise checkpoint",
        "serve": "an OpenAI-compatible HTTP server for a Hugging Face model directory",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        lines = [f"  {name:<9} {text}" for name, text in commands.items()]
        print("usage: shardwise {run,report,estimate,convert,serve} ...\n\n" + "\n".join(lines))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from shardwise.launcher import main as run_main

        return run_main(rest)
    if command == "report":
        from shardwise.tools.report import main as report_main

        return report_main(rest)
    if command == "serve":
        from shardwise.serve._cli import main as serve_main

        return serve_main(rest)
    if command == "convert":
        from shardwise.tools.convert import main as convert_main

        return convert_main(rest)
    from shardwise.tools.estimate import main as estimate_main

    return estimate_main(rest)


if __name__ == "__main__":
    sys.exit(main())
