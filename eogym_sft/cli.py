"""The ``eogym-sft`` console script: argument parsing only, over the package's typed functions."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import TOOL_IMAGES, ImageConfig, add_dataclass_args, config_from_args, number
from .guards import check_model_source, check_output, check_torch_stack, file_name, user_errors
from .quiet import quiet_deepspeed_probe


def add_overwrite_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --output (refused otherwise)")


def add_prepare_args(parser: argparse.ArgumentParser) -> None:
    from .data.prepare import PrepConfig

    parser.add_argument("--input", nargs="+", required=True, help="EO-Gym JSONL file(s)")
    parser.add_argument("--model", required=True,
                        help="hub id or local folder whose processor and chat template are used")
    parser.add_argument("--output", required=True, help="folder for dataset/, manifest.jsonl and stats.json")
    add_dataclass_args(parser, ImageConfig)  # the processor carries the pixel settings, PrepConfig the rest
    add_dataclass_args(parser, PrepConfig)
    parser.add_argument("--num-proc", type=number(int, 1), default=1, help="worker processes")
    parser.add_argument(
        "--allow-drops", action="store_true",
        help="go on when more than half of the rows are dropped for one reason (refused otherwise)"
    )
    add_overwrite_arg(parser)


def run_prepare(args: argparse.Namespace) -> dict:
    from .data.prepare import DROP_SHARE, PrepConfig

    image = config_from_args(ImageConfig, args)
    cfg = config_from_args(PrepConfig, args, max_drop_share=1.0 if args.allow_drops else DROP_SHARE)
    for path in args.input:  # refused before the heavy imports below
        if not Path(path).is_file():
            raise SystemExit(f"eogym-sft prepare: no such input file: {path}")
    check_output(args.output, "eogym-sft prepare", args.overwrite, "prepared dataset", inputs=args.input)
    check_model_source(args.model)
    check_torch_stack()
    from .data.datasets import prepare_dataset
    from .models.processor import load_processor

    processor = load_processor(args.model, image.max_pixels, image.min_pixels)
    stats = prepare_dataset(args.input, args.model, processor, cfg, args.output, args.num_proc)
    print(f"wrote {args.output}/dataset, manifest.jsonl, stats.json")
    return stats


def add_tiny_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True,
                        help="folder to write the tiny random Qwen3-VL and its processor to")
    parser.add_argument("--seed", type=number(int), default=0)
    parser.add_argument("--config", help="architecture config JSON (default: the tiny one), e.g. "
                                         "recipes/configs/qwen3_vl_4b_instruct.json")
    parser.add_argument("--dtype", default="float32", help="weight dtype, e.g. bfloat16 for the 4B architecture")
    parser.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is much faster for 4B)")
    add_overwrite_arg(parser)


def run_tiny(args: argparse.Namespace) -> None:
    check_output(args.output, "eogym-sft tiny-model", args.overwrite, "model")
    check_torch_stack()
    from .models.tiny import save_tiny_model

    config = json.loads(Path(args.config).read_text()) if args.config else None
    path = save_tiny_model(args.output, args.seed, config, args.dtype, args.device)
    print(f"random-weight Qwen3-VL written to {path}")


def add_validate_args(parser: argparse.ArgumentParser) -> None:
    from .evaluation.run_args import add_validate_args as add

    add(parser)


def run_validate(args: argparse.Namespace) -> dict:
    from .evaluation.run_args import (ValidateConfig, check_validate_output, refuse_foreign_adapters,
                                      refuse_missing_inputs)

    cfg = config_from_args(ValidateConfig, args)
    refuse_foreign_adapters(cfg.adapters, cfg.model, cfg.allow_other_base)
    if not Path(cfg.data).is_dir():
        refuse_missing_inputs([p for p in cfg.data.split(",") if p], "eogym-sft validate")
    check_validate_output(cfg)
    check_model_source(cfg.model)
    check_torch_stack()
    from .evaluation.validate import validate

    return validate(cfg)


def add_evaluate_args(parser: argparse.ArgumentParser) -> None:
    from .evaluation.run_args import add_evaluate_args as add

    add(parser)


def run_evaluate(args: argparse.Namespace) -> dict:
    from .evaluation.run_args import EvalConfig, arm_inputs, refuse_foreign_adapters, refuse_missing_inputs

    cfg = config_from_args(EvalConfig, args)
    refuse_foreign_adapters(cfg.adapters, cfg.model, cfg.allow_other_base)
    refuse_missing_inputs(cfg.data, "eogym-sft evaluate")
    check_output(cfg.output, "eogym-sft evaluate", cfg.overwrite, "evaluation",
                 inputs=arm_inputs(cfg.data, cfg.adapters))
    check_model_source(cfg.model)
    check_torch_stack()
    from .evaluation.offline import evaluate

    return evaluate(cfg, progress=not args.no_progress)


def add_rollout_args(parser: argparse.ArgumentParser) -> None:
    from .evaluation.run_args import add_rollout_args as add

    add(parser)


def run_rollout(args: argparse.Namespace) -> dict:
    from .evaluation.run_args import (RolloutConfig, refuse_foreign_adapters, refuse_missing_inputs,
                                      refuse_taken_run_folder)

    refuse_missing_inputs(args.data, "eogym-sft rollout")  # before the policy client below, which imports torch
    refuse_taken_run_folder(args.output, args.overwrite, "eogym-sft rollout")
    policies = []
    # the policy client imports torch: only when asked for
    if args.policy_url or args.policy_model or args.policy_config:
        check_torch_stack()
        from .agent.policy_server import policy_servers

        policies = policy_servers(args.policy_url, args.policy_model, args.policy_config)
    cfg = config_from_args(RolloutConfig, args, policies=policies)
    refuse_foreign_adapters(cfg.adapters, cfg.model, cfg.allow_other_base)
    refuse_missing_inputs(cfg.data, "eogym-sft rollout")
    refuse_taken_run_folder(cfg.output, cfg.overwrite, "eogym-sft rollout")
    check_model_source(cfg.model)
    check_torch_stack()
    from .evaluation.rollout import rollout

    return rollout(cfg, progress=not args.no_progress)


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="runs/demo",
                        help="folder for the tiny model, prepared data, adapter and report")
    from .demo import LEARNING_RATE, STEPS, AgentDemoConfig
    from .environment.tasks import TASKS

    agent = AgentDemoConfig()
    parser.add_argument(
        "--steps", type=number(int, 1), default=argparse.SUPPRESS,
        help=f"SFT optimizer steps (of 2 samples); default {STEPS}, with --agent {agent.sft_steps}"
    )
    parser.add_argument(
        "--learning-rate", type=number(float), default=argparse.SUPPRESS,
        help=f"SFT learning rate, high so that a few steps move a small random model; default {LEARNING_RATE}, with "
             f"--agent {agent.sft_learning_rate}",
    )
    parser.add_argument(
        "--agent", action="store_true",
        help="the agent demo instead: SFT -> closed-loop rollouts -> GRPO -> rejection sampling on a task only the "
             "crop tool solves (docs/agent.md)",
    )
    parser.add_argument(
        "--seed", type=number(int), default=argparse.SUPPRESS,
        help=f"with --agent: the questions, the model's weights and every sampled episode (default {agent.seed}); the "
             "same seed, the same report",
    )
    parser.add_argument("--task", choices=sorted(TASKS), default=argparse.SUPPRESS,
                        help=f"with --agent: the task (default {agent.task})")
    add_overwrite_arg(parser)


def agent_demo_config(args: argparse.Namespace):
    """The agent demo's settings: its defaults, but for the flags given (the others are absent: their
    default is SUPPRESS, so each demo keeps its own defaults)."""
    from .demo import AgentDemoConfig

    fields = {"steps": "sft_steps", "learning_rate": "sft_learning_rate", "seed": "seed", "task": "task"}
    try:
        return AgentDemoConfig(**{fields[flag]: value for flag, value in vars(args).items() if flag in fields})
    except ValueError as err:
        raise SystemExit(f"eogym-sft demo --agent: {err}") from None


def run_demo(args: argparse.Namespace) -> dict:
    check_torch_stack()
    from .demo import LEARNING_RATE, STEPS, run_agent_demo
    from .demo import run_demo as run

    if args.agent:
        return run_agent_demo("runs/agent_demo" if args.output == "runs/demo" else args.output, args.overwrite,
                              agent_demo_config(args))
    agent_only = [f"--{flag}" for flag in ("seed", "task") if flag in vars(args)]
    if agent_only:
        raise SystemExit(f"eogym-sft demo: {' and '.join(agent_only)} apply only to the agent demo: add --agent")
    return run(args.output, vars(args).get("steps", STEPS), vars(args).get("learning_rate", LEARNING_RATE),
               args.overwrite)


def add_make_task_args(parser: argparse.ArgumentParser) -> None:
    from .environment.tasks import TASKS

    parser.add_argument("--output", required=True,
                        help="data root to write: tasks.jsonl, EO_GYM_DATA/ (scenes) and image_cache/ (gold crops)")
    parser.add_argument(
        "--task", choices=list(TASKS), default="colour_grid",
        help="colour_grid: one quadrant's colour (one crop); colour_pair: two quadrants' colours in order (two "
             "crops); "
        "colour_count: how many quadrants show a colour (four crops) (docs/agent.md)",
    )
    parser.add_argument("--rows", type=number(int, 1), required=True, help="questions to write")
    parser.add_argument("--seed", type=number(int), default=0,
                        help="which questions: the same seed writes the same bytes")
    parser.add_argument("--start", type=number(int), default=0,
                        help="index of the first question (disjoint ranges give disjoint splits)")
    parser.add_argument("--name", type=file_name, default="tasks.jsonl",
                        help="file name (not a path) of the JSONL under --output")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace --output/--name if it exists (refused otherwise); other files under --output stay, the scenes "
             "of these rows are rewritten",
    )


def run_make_task(args: argparse.Namespace) -> None:
    from .environment.tasks import write_task

    check_output(Path(args.output) / args.name, "eogym-sft make-task", args.overwrite, "task rows")
    try:
        path = write_task(args.output, args.rows, args.seed, args.start, args.name, args.task)
    except ValueError as err:
        raise SystemExit(f"eogym-sft make-task: {err}") from None
    print(f"wrote {args.rows} {args.task} questions to {path} (data root {args.output})")


def add_episodes_args(parser: argparse.ArgumentParser) -> None:
    from .evaluation.episodes_filter import add_episodes_args as add

    add(parser)


def run_episodes(args: argparse.Namespace) -> dict:
    from .evaluation.episodes_filter import run_episodes_filter

    return run_episodes_filter(args)


def add_tool_call_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-root", default=".",
                        help="folder holding EO_GYM_DATA/ and image_cache/ (crops are written under it)")
    parser.add_argument("--tools", default="crop", help="backends to chain, first that answers wins: crop,replay,http")
    parser.add_argument("--row", nargs=2, metavar=("FILE.jsonl", "ID"),
                        help="take the tool schemas and the replay trace from this row")
    parser.add_argument("--http-url", help="tool server URL for the http backend (shape: docs/environment.md)")
    parser.add_argument("--http-config", default="{}",
                        help='other HttpToolServer fields as JSON, e.g. \'{"result_field": "data", "timeout_s": 10}\'')
    parser.add_argument("--tool-images", default=TOOL_IMAGES, help="which result images are attached, as in data prep")
    parser.add_argument("name", help="tool name, e.g. crop_optical_or_sar_image")
    parser.add_argument("arguments", help='arguments as JSON, e.g. \'{"image_url": "EO_GYM_DATA/..", "aoi": [0.25, '
                                          '0.25, 0.75, 0.75]}\'')


def run_tool_call(args: argparse.Namespace) -> None:
    from .environment.backends.http import HttpToolServer
    from .environment.env import find_row, single_call

    row = find_row(*args.row) if args.row else None
    backends = tuple(b.strip() for b in args.tools.split(",") if b.strip())
    http = HttpToolServer.from_config(args.http_url, args.http_config) if args.http_url else None
    result = single_call(args.data_root, args.name, args.arguments, backends, row, http=http, attach=args.tool_images)
    print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    if not result.ok:
        raise SystemExit(1)


COMMANDS = {
    "demo": (add_demo_args, run_demo,
             "prepare the bundled sample, train a tiny Qwen3-VL a few steps on CPU, validate"),
    "prepare": (add_prepare_args, run_prepare, "EO-Gym JSONL -> Qwen3-VL training samples"),
    "tiny-model": (add_tiny_args, run_tiny,
                   "write a random-weight Qwen3-VL (tiny by default) with a real offline processor"),
    "validate": (add_validate_args, run_validate,
                 "loss and token accuracy of an adapter (and its base) on EO-Gym data"),
    "evaluate": (add_evaluate_args, run_evaluate,
                 "score a base model and LoRA adapters turn by turn on reference traces"),
    "tool-call": (add_tool_call_args, run_tool_call, "run one EO-Gym tool call by hand and print its result as JSON"),
    "rollout": (add_rollout_args, run_rollout,
                "closed-loop episodes (tools executed) of a base model and LoRA adapters; Pass@k"),
    "make-task": (add_make_task_args, run_make_task,
                  "write colour_grid questions: a task only the crop tool solves (docs/agent.md)"),
    "episodes": (add_episodes_args, run_episodes,
                 "keep the rollout episodes a rejection-sampling round trains on (correct|incorrect|all)"),
}


def add_view_args(parser: argparse.ArgumentParser) -> None:
    from .evaluation.view import add_view_args as add

    add(parser)


def run_view(args: argparse.Namespace) -> Path:
    from .evaluation.view import run_view as run

    return run(args)


COMMANDS["view"] = (add_view_args, run_view,
                    "one self-contained HTML page of rollouts, evaluations and training runs (offline)")


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    from .training.plan_command import PlanConfig

    add_dataclass_args(parser, PlanConfig)


def run_plan(args: argparse.Namespace) -> dict:
    from .training.plan_command import PlanConfig, run_plan as plan

    cfg = config_from_args(PlanConfig, args)
    result = plan(cfg, args.recipe_argv)
    print(json.dumps(result) if cfg.json else "refused at launch: "
                                              f"{result['refused']}" if result["refused"] else result["line"])
    return result


COMMANDS["plan"] = (
    add_plan_args, run_plan,
    "the memory plan a recipe chooses on a GPU of a given size (recipe flags such as --dataset_path follow), without "
    "a GPU",
)
# Commands that pass the flags they do not know on to a recipe's own parser.
RECIPE_FLAGS = ("plan",)


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand named on the command line (its first word that is not an option), if any."""
    return next((word for word in argv if not word.startswith("-")), None)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every default shown, but for a ``--no-X`` switch, whose default (the setting it turns off is on) would read as
    its opposite."""

    def _get_help_string(self, action):
        return action.help if isinstance(action, argparse._StoreFalseAction) else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """A flag that cannot be parsed (unknown, out of range, not a number) is one line, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (--help lists the flags)\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Every subcommand is listed, but only the chosen one's flags are built: some ``add_*_args`` import
    torch, and ``eogym-sft --help`` or a refused command should not wait for it."""
    formatter = HelpFormatter
    # allow_abbrev=False: a mistyped flag (--max-turn) is refused, not taken as the flag it begins
    parser = Parser(
        prog="eogym-sft", description="LoRA SFT of Qwen3-VL on EO-Gym tool-use traces", formatter_class=formatter,
        allow_abbrev=False
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also: EOGYM_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = chosen_command(argv)
    for name, (add_args, _, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=formatter,
                                        allow_abbrev=False)
        if name == chosen:
            add_args(command_parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    quiet_deepspeed_probe()
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in RECIPE_FLAGS:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.recipe_argv = extra
    with user_errors(f"eogym-sft {args.command}", args.debug):
        COMMANDS[args.command][1](args)


if __name__ == "__main__":
    main(sys.argv[1:])
