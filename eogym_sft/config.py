"""Settings that several commands share, each with one home.

:class:`SampleConfig` is how big a training sample may be: the pixel cap and floor of every image
(:class:`ImageConfig`) and the token budget of a sample (:class:`TokenBudget`). The flags of data prep,
training and ``validate`` read it from here; from then on the processor that
:func:`eogym_sft.models.processor.load_processor` builds from it is the one carrier of the pixel cap (data
prep, the collator and the saved adapter read it there). ``evaluate`` and ``rollout`` take :class:`ImageConfig` and budgets of their own
(``max_prompt_tokens``, ``max_episode_tokens``).
The recipe's own arguments are :class:`EOGymScriptArguments`; the rest are TRL's ``SFTConfig`` (whose
``max_length`` is the token budget and ``padding_free`` the packing switch, the collator's names)
and ``ModelConfig``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

# Which tool-result images the model sees unless told otherwise (a ToolImageRule spec, docs/data.md):
# the images a tool produced, not those it was given.
TOOL_IMAGES = "produced"
TOOL_IMAGES_HELP = "which tool-result images the model sees: produced, attach or text, then TOOL=MODE overrides (docs/data.md)"


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
        metadata={"help": "token budget per sample, image tokens included (longer traces are split by data prep)", "aliases": ["--max-tokens"]},
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
    """What a training run may do with an ``output_dir`` that holds an earlier run (:mod:`eogym_sft.training.resume`)."""

    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "start a new run in an output_dir that holds an earlier run's checkpoints or adapter (they are removed)"}
    )


@dataclass
class EOGymScriptArguments(ImageConfig, OutputDirConfig):
    """Data and image settings of an EO-Gym SFT run (the token budget is ``SFTConfig.max_length``)."""

    dataset_path: str = field(
        default="data/eo_gym/train.jsonl",
        metadata={"help": "a folder made by `eogym-sft prepare`, or EO-Gym JSONL (comma-separated for several), prepared on the way in"},
    )
    data_root: str = field(default="data/eo_gym", metadata={"help": "folder holding EO_GYM_DATA/ and image_cache/"})
    prepared_dir: str | None = field(
        default=None, metadata={"help": "where JSONL input is prepared to (default: <output_dir>/prepared); reused when settings match"}
    )
    eval_fraction: float = field(default=0.02, metadata={"help": "share of traces held out for evaluation, split by trace id"})
    overlong: str = field(default="split", metadata={"help": "over-long traces: split (at assistant turns) or drop"})
    tool_images: str = field(default=TOOL_IMAGES, metadata={"help": TOOL_IMAGES_HELP})
    prep_num_proc: int = field(default=8, metadata={"help": "data-prep worker processes (at most the CPUs this process may use)"})
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
        metadata={"help": "regional torch.compile of each language-model decoder layer and each vision block and patch merger (GPU; compiles during the first steps)"},
    )

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.samples_per_step is not None and self.samples_per_step < 1:
            raise ValueError(f"samples_per_step must be at least 1 (or None), got {self.samples_per_step}")

    def sample_config(self, max_length: int | None) -> SampleConfig:
        """The run's :class:`SampleConfig`: these pixel settings and ``SFTConfig.max_length``."""
        return SampleConfig(max_pixels=self.max_pixels, min_pixels=self.min_pixels, max_length=max_length or SampleConfig.max_length)


# ---------------------------------------------------------------- flags from fields

SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def field_type(f: dataclasses.Field) -> tuple[type, bool]:
    """``(scalar type, is a list)`` of a field annotated ``T``, ``T | None``, ``list[T]`` or ``list[T] | None``."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    (one,) = [part.strip() for part in text.split("|") if part.strip() != "None"]
    if one.startswith("list[") and one.endswith("]"):
        return SCALARS[one[5:-1]], True
    return SCALARS[one], False


def add_dataclass_args(parser: argparse.ArgumentParser, config_type: type) -> None:
    """One flag per field of the dataclass ``config_type``, the one place a CLI setting is declared.

    The flag is ``--field-name`` (``metadata["flag"]`` renames it, ``metadata["aliases"]`` adds names, ``"flag":
    False`` leaves the field off the command line); its default is the field's (none: required); its type comes
    from the annotation (``list[T]``: one or more values); ``help``, ``choices``, ``metavar``, ``nargs``, ``type``,
    ``action`` and ``required`` in the metadata go to ``add_argument`` as they are. A ``bool`` that defaults to
    false is a switch; one that defaults to true or None has a ``--no-`` form."""
    for f in dataclasses.fields(config_type):
        meta = dict(f.metadata)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
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
                    kwargs["type"] = scalar
                if is_list:
                    kwargs.setdefault("nargs", "+")
        parser.add_argument(*names, **kwargs)


def config_from_args(config_type: type, args: argparse.Namespace, **given):
    """``config_type`` built from the flags :func:`add_dataclass_args` made (and ``given``, for fields off the
    command line): its ``__post_init__`` checks them all before a command touches anything."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_type) if f.init and hasattr(args, f.name)}
    return config_type(**{**values, **given})
