"""`scaletrain plan`: a job's parameters, memory per rank, FLOPs, bubble and MFU, without a GPU."""

from __future__ import annotations

import argparse
import dataclasses
import json

from scaletrain.app.commands import launch
from trainer import options


def register(sub: argparse._SubParsersAction) -> None:
    planner = sub.add_parser(
        "plan", help="a job's parameters, per-rank memory, FLOPs, bubble and MFU, without a GPU"
    )
    planner.set_defaults(handler=_plan)
    planner.add_argument(
        "--ranks",
        "--gpus",
        action=options.Renamed,
        type=int,
        default=8,
        help="ranks (one a GPU) of the job, as run --ranks (default 8; --gpus: the old name)",
    )
    planner.add_argument(
        "--device",
        "--gpu",
        action=options.Renamed,
        default="h200",
        help="the GPU model whose memory and dense peak the plan uses (default h200; --gpu: the "
        "old name)",
    )
    planner.add_argument(
        "--tokens-per-s", type=float, help="the target throughput whose MFU to show"
    )
    planner.add_argument("--json", action="store_true", help="print the plan as JSON")
    planner.add_argument(
        "--min-nodes",
        type=int,
        help="also plan the job on every node count from its own down to this one, as an "
        "elastic job (--nodes MIN:MAX) re-forms after losing nodes",
    )
    planner.add_argument(
        "--ranks-per-node",
        "--gpus-per-node",
        action=options.Renamed,
        type=int,
        default=8,
        help="ranks a node, for --min-nodes and an MoE's all-to-all bytes within and across "
        "nodes (default 8; --gpus-per-node: the old name)",
    )
    launch.launcher_args(planner, launch.RUN_DEFAULTS)
    launch.trainer_options(planner)


def _plan(args: argparse.Namespace) -> int:
    from scaletrain.app.plan import elastic_sizes, plan, render, render_elastic

    job = launch.resolve_job(args, launch.RUN_DEFAULTS)
    if args.print_config:
        print(options.to_toml(job), end="")
        return 0
    job = job | {"run_id": job["run_id"] or "plan"}
    planned = plan(job, args.ranks, args.device, args.tokens_per_s, args.ranks_per_node)
    sizes = None
    if args.min_nodes is not None:
        sizes = elastic_sizes(job, args.ranks, args.ranks_per_node, args.min_nodes, args.device)
    if args.json:
        shown = planned.as_json()
        if sizes is not None:
            shown["elastic"] = [dataclasses.asdict(size) for size in sizes]
        print(json.dumps(shown, indent=2))
        return 0
    print(render(planned))
    if sizes is not None:
        print(render_elastic(sizes, args.ranks_per_node))
    return 0
