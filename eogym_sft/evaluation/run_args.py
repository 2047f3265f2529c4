"""The settings and flags that ``eogym-sft evaluate`` and ``eogym-sft rollout`` share: which arms, where
they run, the image settings of data prep, the judge hook, and the run's housekeeping."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import ImageConfig
from ..data.tool_images import ToolImageRule

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(kw_only=True)
class ArmsConfig(ImageConfig):
    """The settings both commands share (the pixel settings of :class:`ImageConfig`); each command's token budget
    has its own name (``max_prompt_tokens``, ``max_episode_tokens``);
    :class:`~eogym_sft.evaluation.offline.EvalConfig` and :class:`~eogym_sft.evaluation.rollout.RolloutConfig` add their own."""

    model: str
    data: list[str]
    output: str | None = None
    adapters: list[str] = field(default_factory=list)  # "DIR" or "NAME=DIR"
    data_root: str = "."
    include_base: bool = True
    allow_other_base: bool = False  # use adapters whose adapter_config.json names another base
    limit: int | None = None
    tool_images: str = "produced"
    samples: int = 1  # outputs (evaluate) or episodes (rollout) per item: the n of pass@k
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 512
    judge: str | None = None  # "module:function"
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    overwrite: bool = False
    allow_drops: bool = False  # go on when more than half of the rows (or turns) are dropped for one reason

    def __post_init__(self):
        super().__post_init__()
        ToolImageRule.parse(self.tool_images)  # raises ValueError on a bad spec
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if not self.has_arms():
            raise ValueError("nothing to run: no base arm and no adapters")
        if min(self.samples, self.max_new_tokens) < 1:
            raise ValueError("samples and max_new_tokens must be at least 1")
        if self.samples > 1 and self.temperature <= 0:
            raise ValueError(f"--samples {self.samples} needs --temperature > 0 (greedy outputs would all be equal)")


    def has_arms(self) -> bool:
        """Whether any arm is asked for (a subclass with arms of another kind widens this)."""
        return self.include_base or bool(self.adapters)


def recorded_settings(cfg: ArmsConfig, arms: list, device, dtype) -> dict:
    """What ``summary.json`` records of a run: every setting, the arms, device, dtype, data hashes, versions."""
    from ..data.datasets import file_sha256
    from ..provenance import versions

    return {
        **asdict(cfg),
        "arms": [asdict(a) for a in arms],
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "data_sha256": {f: file_sha256(f) for f in cfg.data},
        "versions": versions(),
    }


def shared_settings(args, command: str) -> dict:
    """The :class:`ArmsConfig` fields from parsed flags; a missing ``--data`` file stops ``command`` here."""
    for path in args.data:
        if not Path(path).is_file():
            raise SystemExit(f"{command}: no such data file: {path}")
    return {
        "model": args.model, "data": args.data, "output": args.output, "adapters": args.adapter, "data_root": args.data_root,
        "include_base": not args.no_base, "allow_other_base": args.allow_other_base, "limit": args.limit,
        "max_pixels": args.max_pixels, "min_pixels": args.min_pixels, "tool_images": args.tool_images, "judge": args.judge,
        "samples": args.samples, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "max_new_tokens": args.max_new_tokens, "seed": args.seed, "device": args.device, "dtype": args.dtype, "overwrite": args.overwrite,
        "allow_drops": args.allow_drops,
    }


def add_shared_args(parser, verb: str) -> None:
    """Add the shared flags to ``parser``; ``verb`` words the ``--no-base`` help ("evaluate", "roll out")."""
    add = parser.add_argument
    add("--model", required=True, help="base model: hub id or local folder (its processor and chat template are used)")
    add("--adapter", nargs="+", action="extend", default=[], metavar="[NAME=]DIR", help="LoRA adapter folder(s), each one arm")
    add("--no-base", action="store_true", help=f"do not {verb} the base model as an arm")
    add("--allow-other-base", action="store_true", help="use adapters trained on a base of another name (the same weights renamed)")
    add("--data-root", default=".", help="folder holding EO_GYM_DATA/ and image_cache/")
    add("--limit", type=int, default=None, help="read only the first N input rows")
    add("--max-pixels", type=int, default=ImageConfig.max_pixels, help="pixel cap per image, as in data prep")
    add("--min-pixels", type=int, default=ImageConfig.min_pixels, help="pixel floor per image, as in data prep")
    add("--tool-images", default="produced", help="which tool-result images the model sees, as in data prep (docs/data.md)")
    add("--samples", type=int, default=1, help="outputs per turn (evaluate) or episodes per question (rollout): the n of pass@k; > 1 needs --temperature")
    add("--max-new-tokens", type=int, default=512, help="tokens per generated message")
    add("--temperature", type=float, default=0.0, help="0 = greedy decoding")
    add("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    add("--top-k", type=int, default=0, help="top-k sampling when --temperature > 0 (0 = off)")
    add("--judge", default=None, metavar="MODULE:FUNCTION", help="judge(question, prediction, reference) -> bool for final answers")
    add("--seed", type=int, default=0)
    add("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    add("--dtype", default="auto", choices=DTYPES, help="auto = bf16 on GPU, fp32 on CPU")
    add("--overwrite", action="store_true", help="write into a non-empty --output (files of an earlier run are replaced)")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--allow-drops", action="store_true", help="go on when more than half of the rows are dropped for one reason (refused otherwise)")
