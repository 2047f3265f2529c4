"""Settings that several commands share, each with one home.

:class:`SampleConfig` is how big a training sample may be: the pixel cap and floor of every image
(:class:`ImageConfig`) and the token budget of a sample (:class:`TokenBudget`). The flags of data prep,
training and ``validate`` read it from here; from then on the processor that
:func:`eogym_sft.models.processor.load_processor` builds from it is the one carrier of the pixel cap (data
prep, the collator and the saved adapter read it there). ``evaluate`` and ``rollout`` take :class:`ImageConfig` and
budgets of their own (``max_prompt_tokens``, ``max_episode_tokens``).
The recipe's own arguments are :class:`EOGymScriptArguments`; the rest are TRL's ``SFTConfig`` (whose
``max_length`` is the token budget and ``padding_free`` the packing switch, the collator's names)
and ``ModelConfig``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import types
import typing
from dataclasses import dataclass, field

# Which tool-result images the model sees unless told otherwise (a ToolImageRule spec, docs/data.md):
# the images a tool produced, not those it was given.
TOOL_IMAGES = "produced"
TOOL_IMAGES_HELP = (
    "which tool-result images the model sees: produced, attach or text, then TOOL=MODE overrides (docs/data.md)"
)


@dataclass
class ImageConfig:
    """How images are resized: Qwen-VL keeps the aspect ratio and scales into ``[min_pixels, max_pixels]``."""

    max_pixels: int = field(default=1003520, metadata={"help": "pixel cap per image: 980 visual tokens on Qwen3-VL"})
    min_pixels: int = field(default=65536, metadata={"help": "pixel floor per image (Qwen3-VL's processor default)"})

    def __post_init__(self):
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")


@dataclass
class TokenBudget:
    """The token budget of one sample, image tokens included (data prep splits longer traces)."""

    max_length: int = field(
        default=8192,
        metadata={"help": "token budget per sample, image tokens included (longer traces are split by data prep)",
                  "aliases": ["--max-tokens"]},
    )

    def __post_init__(self):
        if self.max_length < 1:
            raise ValueError(f"max_length must be at least 1, got {self.max_length}")


@dataclass
class SampleConfig(TokenBudget, ImageConfig):
    """Images as in :class:`ImageConfig`, and the token budget of :class:`TokenBudget`."""

    def __post_init__(self):
        ImageConfig.__post_init__(self)
        TokenBudget.__post_init__(self)


@dataclass
class OutputDirConfig:
    """What a training run may do with an ``output_dir`` that holds an earlier run
    (:mod:`eogym_sft.training.resume`)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "start a new run in an output_dir that holds an earlier run's checkpoints or adapter (they "
                          "are removed)"}
    )


@dataclass
class EOGymScriptArguments(ImageConfig, OutputDirConfig):
    """Data and image settings of an EO-Gym SFT run (the token budget is ``SFTConfig.max_length``)."""

    dataset_path: str = field(
        default="data/eo_gym/train.jsonl",
        metadata={"help": "a folder made by `eogym-sft prepare`, or EO-Gym JSONL (comma-separated for several), "
                          "prepared on the way in"},
    )
    data_root: str = field(default="data/eo_gym", metadata={"help": "folder holding EO_GYM_DATA/ and image_cache/"})
    prepared_dir: str | None = field(
        default=None,
        metadata={"help": "where JSONL input is prepared to (default: <output_dir>/prepared); reused when settings "
                          "match"}
    )
    eval_fraction: float = field(default=0.02,
                                 metadata={"help": "share of traces held out for evaluation, split by trace id"})
    overlong: str = field(default="split", metadata={"help": "over-long traces: split (at assistant turns) or drop"})
    tool_images: str = field(default=TOOL_IMAGES, metadata={"help": TOOL_IMAGES_HELP})
    prep_num_proc: int = field(default=8,
                               metadata={"help": "data-prep worker processes (at most the CPUs this process may use)"})
    allow_drops: bool = field(
        default=False,
        metadata={
            "help": "go on when more than half of the rows are dropped in data prep for one reason, or most images of "
            "the first samples are not under data_root (refused otherwise); zero usable samples are refused always"
        },
    )
    samples_per_step: int | None = field(
        default=64,
        metadata={
            "help": "samples per optimizer step on any number of GPUs: gradient_accumulation_steps is derived as "
            "samples_per_step / (per_device_train_batch_size x world size), and a split that does not divide is "
            "refused; None keeps gradient_accumulation_steps as given"
        },
    )
    compile_layers: bool = field(
        default=False,
        metadata={"help": "regional torch.compile of each language-model decoder layer and each vision block and "
                          "patch merger (GPU; compiles during the first steps)"},
    )

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.samples_per_step is not None and self.samples_per_step < 1:
            raise ValueError(f"samples_per_step must be at least 1 (or None), got {self.samples_per_step}")
        if self.prep_num_proc < 1:
            raise ValueError(f"prep_num_proc must be at least 1, got {self.prep_num_proc}")

    def sample_config(self, max_length: int | None) -> SampleConfig:
        """The run's :class:`SampleConfig`: these pixel settings and ``SFTConfig.max_length``."""
        return SampleConfig(max_pixels=self.max_pixels, min_pixels=self.min_pixels,
                            max_length=max_length or SampleConfig.max_length)


# ---------------------------------------------------------------- values against their fields' types


def fits(value, hint) -> bool:
    """Whether ``value`` (parsed YAML or JSON) is of the type ``hint`` (a resolved annotation)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, h) for h in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is list or hint is list:
        element = args[0] if args else typing.Any
        # one value, as a flag gives it
        one = bool(args) and not isinstance(value, (list, dict)) and fits(value, element)
        return (isinstance(value, list) and all(fits(v, element) for v in value)) or one
    if origin is dict or hint is dict:
        inner = args[1] if len(args) == 2 else typing.Any
        return isinstance(value, dict) and all(isinstance(k, str) and fits(v, inner) for k, v in value.items())
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return any(value == member.value for member in hint)
    return False  # another class (a parallelism config): not settable from a file


def describe(hint) -> str:
    """``hint`` in words, for a refusal."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(h) for h in args))
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is list or hint is list:
        return f"a list of {describe(args[0]) if args else 'values'}"
    if origin is dict or hint is dict:
        return "a mapping"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    words = {type(None): "null", bool: "true or false", int: "a whole number", float: "a finite number",
             str: "a string"}
    return words.get(hint, getattr(hint, "__name__", str(hint)))


def check_types(instance, what: str) -> None:
    """``ValueError`` naming the first field of the dataclass ``instance`` whose value is not of its annotated type
    (settings read from JSON or YAML, where ``"8"``, ``true`` or ``NaN`` can stand where a number is meant)."""
    hints = typing.get_type_hints(type(instance))
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if not fits(value, hints[f.name]):
            raise ValueError(f"{what} {f.name} must be {describe(hints[f.name])}, got {value!r}"[:300])


# ---------------------------------------------------------------- flags from fields

SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def field_type(f: dataclasses.Field) -> tuple[type, bool]:
    """``(scalar type, is a list)`` of a field annotated ``T``, ``T | None``, ``list[T]`` or ``list[T] | None``."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    (one,) = [part.strip() for part in text.split("|") if part.strip() != "None"]
    if one.startswith("list[") and one.endswith("]"):
        return SCALARS[one[5:-1]], True
    return SCALARS[one], False


def number(kind: type, low: float = 0, high: float | None = None):
    """An argparse ``type`` for a count, budget, port or seconds: a ``kind`` (int or float) that is finite and in
    ``[low, high]``, or a one-line refusal at parse time (``--port 99999``, ``--image-budget-mb inf``, ``-1``)."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {'whole number' if kind is int else 'number'}: "
                                             f"{text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or (high is not None and value > high):
            span = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


def add_dataclass_args(parser: argparse.ArgumentParser, config_type: type) -> None:
    """One flag per field of the dataclass ``config_type``, the one place a CLI setting is declared.

    The flag is ``--field-name`` (``metadata["flag"]`` renames it, ``metadata["aliases"]`` adds names, ``"flag":
    False`` leaves the field off the command line); its default is the field's (none: required); its type comes
    from the annotation (``list[T]``: one or more values); ``help``, ``choices``, ``metavar``, ``nargs``, ``type``,
    ``action`` and ``required`` in the metadata go to ``add_argument`` as they are. A ``bool`` that defaults to
    false is a switch; one that defaults to true or None has a ``--no-`` form. An ``int`` or ``float`` is checked
    by :func:`number`: finite and at least ``metadata["min"]`` (default 0), at most ``metadata["max"]`` if given."""
    for f in dataclasses.fields(config_type):
        meta = dict(f.metadata)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        low, high = meta.pop("min", 0), meta.pop("max", None)
        if flag is False:
            continue
        names = [flag, *meta.pop("aliases", [])]
        kwargs = {"dest": f.name, **meta}
        if f.default is not dataclasses.MISSING:
            kwargs["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kwargs["default"] = f.default_factory()
        else:
            kwargs["required"] = True
        if "action" not in kwargs and "type" not in kwargs:
            scalar, is_list = field_type(f)
            if scalar is bool:
                kwargs["action"] = "store_true" if kwargs.get("default") is False else argparse.BooleanOptionalAction
            else:
                if scalar is not str:
                    kwargs["type"] = number(scalar, low, high)
                if is_list:
                    kwargs.setdefault("nargs", "+")
        parser.add_argument(*names, **kwargs)


def config_from_args(config_type: type, args: argparse.Namespace, **given):
    """``config_type`` built from the flags :func:`add_dataclass_args` made (and ``given``, for fields off the
    command line): its ``__post_init__`` checks them all before a command touches anything."""
    values = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(config_type) if f.init and hasattr(args, f.name)
    }
    return config_type(**{**values, **given})
