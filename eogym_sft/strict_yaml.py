"""The recipes' YAML, read strictly: :class:`RecipeParser` is TRL's ``TrlParser`` with a stricter ``--config``.

``yaml.safe_load`` (what ``TrlParser`` uses) keeps the last of two equal keys, follows aliases into values of
any size (``&a [*a, *a]`` nine deep is a billion items once a consumer walks it), accepts ``!!str``-style tags,
and hands a value of any type to the dataclass field it names: ``learning_rate: [1, 2]`` reached the optimizer
after data prep and model load. Here, through PyYAML's own hooks (a ``SafeLoader`` subclass):

* a key given twice, an explicit tag, a value whose aliases expand past :data:`MAX_NODES` values, or nesting
  past :data:`MAX_DEPTH` is refused;
* every value is checked against the type of the field it sets (a string where a number is meant is taken
  only if the flag's own conversion takes it, as it would on the command line); no float is NaN or infinite,
  from the file or from a flag;
* a TRL or transformers setting with no range check of its own is held to its range (:data:`UPSTREAM_RANGES`):
  a negative batch, LoRA rank or learning rate otherwise fails deep in a run, or trains nothing;

each refusal a ``ValueError`` of one line naming the file, the line and the key, before anything is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import typing
from pathlib import Path

import yaml
from trl import TrlParser

from .config import describe, fits

MAX_NODES = 10_000  # values of one file with every alias expanded; the shipped recipes have about 150
MAX_DEPTH = 16  # nesting of one value; the recipes nest 2 deep
MAX_BYTES = 1 << 20

# (lowest, whether the lowest itself is allowed, a bound the value stays below or None). Our own settings check
# their ranges in their dataclasses' __post_init__; transformers checks warmup_steps and few others.
UPSTREAM_RANGES = {
    "learning_rate": (0, False, None),
    "num_train_epochs": (0, True, None),  # 0 with max_steps > 0 is a run; with max_steps -1 the recipe refuses it
    "per_device_train_batch_size": (1, True, None),
    "per_device_eval_batch_size": (1, True, None),
    "gradient_accumulation_steps": (1, True, None),
    "eval_accumulation_steps": (1, True, None),
    "weight_decay": (0, True, None),
    "adam_beta1": (0, True, 1),
    "adam_beta2": (0, True, 1),
    "adam_epsilon": (0, True, None),
    "max_grad_norm": (0, True, None),
    "logging_steps": (0, False, None),
    "save_steps": (0, False, None),
    "eval_steps": (0, False, None),
    "save_total_limit": (0, True, None),
    "seed": (0, True, None),
    "data_seed": (0, True, None),
    "dataloader_num_workers": (0, True, None),
    "dataloader_prefetch_factor": (1, True, None),
    "max_length": (1, True, None),
    "lora_r": (1, True, None),
    "lora_alpha": (0, False, None),
    "lora_dropout": (0, True, 1),
    "num_generations": (2, True, None),
    "max_completion_length": (1, True, None),
    "num_iterations": (1, True, None),
    "temperature": (0, False, None),
    "beta": (0, True, None),
    "epsilon": (0, True, None),
    "epsilon_high": (0, True, None),
}


def out_of_range(name: str, value) -> str | None:
    """Why the number ``value`` is no value of the setting ``name`` (NaN, infinite, or outside the range
    :data:`UPSTREAM_RANGES` gives it), or None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if name not in UPSTREAM_RANGES:
        return None
    low, low_allowed, below = UPSTREAM_RANGES[name]
    if value < low or (value == low and not low_allowed) or (below is not None and value >= below):
        span = f"at least {low}" if low_allowed else f"above {low}"
        return f"must be {span}{'' if below is None else f' and below {below}'}, got {value}"
    return None


class StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses explicit tags and duplicate keys, naming the line (1-based)."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        tag = getattr(event, "tag", None)
        if tag is not None:
            key = index.value if isinstance(index, yaml.ScalarNode) else None
            raise _Refused(event.start_mark.line + 1, key, f"the tag {tag} is refused (plain values only)")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    raise _Refused(line, key_node.value, f"given twice (first on line {seen[key_node.value]})")
                seen[key_node.value] = line
        return super().construct_mapping(node, deep=deep)


class _Refused(Exception):
    def __init__(self, line: int, key, why: str):
        super().__init__(why)
        self.line, self.key, self.why = line, key, why


def _expanded(node, depth: int, sizes: dict, active: set) -> int:
    """Values ``node`` stands for with every alias expanded; raises ``_Refused`` past the bounds."""
    if id(node) in sizes:
        return sizes[id(node)]
    if depth > MAX_DEPTH:
        raise _Refused(node.start_mark.line + 1, None, f"nested more than {MAX_DEPTH} levels deep")
    if id(node) in active:
        raise _Refused(node.start_mark.line + 1, None, "an alias refers to a value that holds it (an endless value)")
    active.add(id(node))
    children = (
        []
        if isinstance(node, yaml.ScalarNode)
        else [n for pair in node.value for n in pair]
        if isinstance(node, yaml.MappingNode)
        else node.value
    )
    total = 1
    for child in children:
        total += _expanded(child, depth + 1, sizes, active)
        if total > MAX_NODES:
            raise _Refused(node.start_mark.line + 1, None,
                           f"expands to more than {MAX_NODES} values through aliases (*name)")
    active.discard(id(node))
    sizes[id(node)] = total
    return total


def load_recipe_yaml(path: str | Path) -> tuple[dict, dict[str, int]]:
    """The settings in the YAML file ``path`` and the line of each key; ``ValueError`` naming file, line
    and key for anything :class:`StrictLoader` or the bounds refuse."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    if path.stat().st_size > MAX_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, more than a recipe's settings take ({MAX_BYTES}): not "
                         "a recipe YAML?")
    loader = StrictLoader(path.read_text(encoding="utf-8", errors="replace"))
    key = None
    try:
        root = loader.get_single_node()
        if root is None or not isinstance(root, yaml.MappingNode):
            raise ValueError(f"{path}: must hold a YAML mapping of settings (name: value)")
        lines = {}
        for key_node, value_node in root.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            lines[key] = key_node.start_mark.line + 1
            _expanded(value_node, 1, {}, set())
        return loader.construct_document(root), lines
    except _Refused as err:
        raise ValueError(f"{path}:{err.line}: {err.key or key or 'a key'}: {err.why}") from None
    except RecursionError:
        raise ValueError(f"{path}: nested more than {MAX_DEPTH} levels deep") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f":{mark.line + 1}" if mark else ""
        raise ValueError(f"{path}{where}: not valid YAML ({err.problem or err.context})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    finally:
        loader.dispose()


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class RecipeParser(TrlParser):
    """``TrlParser`` whose ``--config`` is read by :func:`load_recipe_yaml` and typed against the recipe's
    dataclasses before any value reaches them; NaN and infinite floats are refused from flags too."""

    def parse_args_and_config(self, args=None, return_remaining_strings=False, fail_with_unknown_args=True,
                              separate_remaining_strings=False):
        args = list(sys.argv[1:] if args is None else args)
        if "--config" in args:
            at = args.index("--config")
            if at + 1 == len(args):
                raise ValueError("--config needs a YAML file")
            path = args[at + 1]
            del args[at : at + 2]
            config = self.checked_config(path)
            for name, value in config.pop("env", {}).items():
                os.environ[name] = str(value)
            self.set_defaults_with_config(**config)
        # before the dataclasses are built: GRPOConfig's own check of a negative batch names another setting
        for name, value in vars(self.parse_known_args(args)[0]).items():
            if why := out_of_range(name, value):
                raise ValueError(f"--{name}: {why}")
        return super().parse_args_and_config(args, return_remaining_strings, fail_with_unknown_args,
                                             separate_remaining_strings)

    def checked_config(self, path: str) -> dict:
        """The settings of ``path``, each of the type of the field it sets (``ValueError`` naming file, line, key)."""
        config, lines = load_recipe_yaml(path)
        fields = {}
        for config_type in self.dataclass_types:
            hints = typing.get_type_hints(config_type)
            fields.update({f.name: hints[f.name] for f in dataclasses.fields(config_type) if f.init})
        actions = {action.dest: action for action in self._actions}
        for key, value in config.items():
            where = f"{path}:{lines.get(key, '?')}: {key}"
            if key == "env":
                if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, (str, int, float, bool)) for k, v in value.items()
                ):
                    raise ValueError(f"{where}: expected a mapping of environment variables to plain values")
                continue
            if not isinstance(key, str) or key not in fields:
                raise ValueError(f"{where}: not a setting of this recipe (a misspelt name?)")
            converts = _converts(value, actions.get(key))
            if not (fits(value, fields[key]) or converts):
                raise ValueError(f"{where}: expected {describe(fields[key])}, got {type(value).__name__} "
                                 f"{_shown(value)}")
            if why := out_of_range(key, actions[key].type(value) if converts else value):
                raise ValueError(f"{where}: {why}")
        return config


def _converts(value, action) -> bool:
    """Whether ``value`` is a string the flag's own conversion takes (``learning_rate: 1e-4`` is a string to
    YAML 1.1, a float to the flag), to a finite number where it gives one."""
    if not isinstance(value, str) or action is None or not callable(action.type):
        return False
    try:
        converted = action.type(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return not (isinstance(converted, float) and not math.isfinite(converted))
