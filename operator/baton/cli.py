"""The `baton` command: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args)`;
it is imported only when chosen, so `baton --help` stays fast and a control-plane image
does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Add a subcommand by adding a line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("baton.local.demo", "start the local stack, stream one chat answer to the terminal, stop"),
    "chat": ("baton.engine.chat", "load a model in this process and stream one chat answer (no servers)"),
    "simulate": ("baton.sim.simulate", "simulate a fleet over a day: controller vs best static split vs hourly oracle"),
    "plan": ("baton.sim.plan", "recommend a prefill/decode split and show the KV transfer table"),
    "crds": ("baton.api.crdgen", "write the PDDeployment CustomResourceDefinition from the API models"),
    "operator": ("baton.operator.main", "run the Kubernetes operator that reconciles PDDeployments"),
    "remove-deployments": ("baton.operator.uninstall", "delete every PDDeployment and wait until the operator has drained and removed them"),
    "worker": ("baton.server.main", "run an inference worker (prefill, decode or both) with its internal API"),
    "router": ("baton.router.main", "serve the OpenAI API in front of prefill and decode workers"),
    "up": ("baton.local.up", "run workers and router on a local Ray instance (or join one)"),
    "bench": ("baton.loadgen.main", "load-test an OpenAI endpoint: TTFT, TPOT, ITL, goodput, timeline"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage or an error naming the unknown command
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"baton {name}", description=COMMANDS[name][1])
    module.add_arguments(sub)
    args = sub.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
