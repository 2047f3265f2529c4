"""The settings of ``eogym-sft validate``, ``evaluate`` and ``rollout``, and their flags.

Each setting is declared once, as a field of :class:`ValidateConfig`, :class:`EvalConfig` or
:class:`RolloutConfig` (those of both evaluate and rollout in :class:`ArmsConfig`): the flags are made from the
fields by :func:`eogym_sft.config.add_dataclass_args`, and ``__post_init__`` checks every value, so a bad setting
stops any entry point before it writes anything. This module imports neither torch nor a model: ``--help`` and a
refused command answer at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..agent.rollout_config import CPU_BATCH, CPU_SLOTS, MAX_EPISODE_TOKENS
from ..config import TOOL_IMAGES, TOOL_IMAGES_HELP, ImageConfig, SampleConfig, add_dataclass_args
from ..data.tool_images import ToolImageRule
from ..environment.env import BACKENDS, DEFAULT_BACKENDS
from ..guards import check_adapter_base, check_output
from ..metrics.judge import DEFAULT_JUDGE_MODEL, ChatJudge
from ..net import check_url

if TYPE_CHECKING:
    from ..agent.policy_server import PolicyServer  # imports torch

VALIDATE_BATCHES = (32, 16, 8, 4, 2, 1)  # samples a forward validate tries, most first
DTYPES = ("auto", "bfloat16", "float16", "float32")
ADAPTERS = {"flag": "--adapter", "action": "extend", "nargs": "+", "metavar": "[NAME=]DIR",
            "help": "LoRA adapter folder(s), each one arm"}
NO_BASE = {"flag": "--no-base", "action": "store_false", "help": "do not run the base model (adapters off) as an arm"}
OTHER_BASE = {"help": "use adapters trained on a base of another name (the same weights renamed)"}
DATA_ROOT = {"help": "folder holding EO_GYM_DATA/ and image_cache/"}
DEVICE = {"help": "auto (cuda if available), cpu, cuda, cuda:1, ..."}
DTYPE = {"choices": DTYPES, "help": "auto = bf16 on GPU, fp32 on CPU"}


def comma_list(text: str) -> list[str]:
    """``"crop,replay"`` -> ``["crop", "replay"]``."""
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclass(kw_only=True)
class ArmsConfig(ImageConfig):
    """The settings evaluate and rollout share (the pixel settings of :class:`ImageConfig`); each command's token
    budget has its own name (``max_prompt_tokens``, ``max_episode_tokens``)."""

    model: str = field(metadata={"help": "base model: hub id or local folder (its processor and chat template are "
                                         "used)"})
    data: list[str] = field(
        metadata={"help": "EO-Gym JSONL file(s): reference traces (evaluate), or rows that may carry only the "
                          "question (rollout)"}
    )
    output: str | None = field(
        default=None,
        metadata={"required": True,
                  "help": "folder for the run's files: results or episodes, skipped.jsonl, summary.json, report.txt"}
    )
    adapters: list[str] = field(default_factory=list, metadata=ADAPTERS)  # "DIR" or "NAME=DIR"
    data_root: str = field(default=".", metadata=DATA_ROOT)
    include_base: bool = field(default=True, metadata=NO_BASE)
    allow_other_base: bool = field(default=False, metadata=OTHER_BASE)
    limit: int | None = field(default=None,
                              metadata={"help": "read only the first N input rows (at least 1; default: every row)"})
    tool_images: str = field(default=TOOL_IMAGES, metadata={"help": TOOL_IMAGES_HELP})
    samples: int = field(
        default=1,
        metadata={"help": "outputs per turn (evaluate) or episodes per question (rollout): the n of pass@k; > 1 needs "
                          "--temperature"}
    )
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy decoding"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling when --temperature > 0", "max": 1.0})
    top_k: int = field(default=0, metadata={"help": "top-k sampling when --temperature > 0 (0 = off)"})
    max_new_tokens: int = field(default=512, metadata={"help": "tokens per generated message"})
    judge: str | None = field(
        default=None,
        metadata={"metavar": "MODULE:FUNCTION",
                  "help": "judge(question, prediction, reference) -> bool for final answers"}
    )
    seed: int = field(default=0, metadata={"help": "seed of sampling (the same per batch in every arm)"})
    device: str = field(default="auto", metadata=DEVICE)
    dtype: str = field(default="auto", metadata=DTYPE)
    overwrite: bool = field(default=False, metadata={"help": "write into a non-empty --output (files of an earlier "
                                                             "run are replaced)"})
    allow_drops: bool = field(
        default=False,
        metadata={"help": "go on when more than half of the rows are dropped for one reason (refused otherwise)"}
    )

    def __post_init__(self):
        super().__post_init__()
        ToolImageRule.parse(self.tool_images)  # raises ValueError on a bad spec
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if not self.has_arms():
            raise ValueError("nothing to run: no base arm and no adapters")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be at least 1 (leave it out to read every row), got {self.limit}")
        if min(self.samples, self.max_new_tokens) < 1:
            raise ValueError("samples and max_new_tokens must be at least 1")
        if self.samples > 1 and self.temperature <= 0:
            raise ValueError(f"--samples {self.samples} needs --temperature > 0 (greedy outputs would all be equal)")

    def has_arms(self) -> bool:
        """Whether any arm is asked for (a subclass with arms of another kind widens this)."""
        return self.include_base or bool(self.adapters)


@dataclass(kw_only=True)
class EvalConfig(ArmsConfig):
    """Settings of an evaluation run (the flags of ``eogym-sft evaluate``); ``max_prompt_tokens`` caps a turn's
    prompt, image tokens included (a training sample's budget by default)."""

    max_prompt_tokens: int = field(
        default=SampleConfig.max_length,
        metadata={"aliases": ["--max-length"], "help": "skip turns whose prompt is longer (image tokens included)"}
    )
    batch_size: int | None = field(
        default=None,
        metadata={"help": "prompts decoded at once (default: as many as the GPU holds beside the model, a prefill and "
                          f"the merged LoRA weights; {CPU_BATCH} off CUDA)"},
    )
    num_tolerance: float = field(default=1e-6,
                                 metadata={"help": "numbers in arguments match when |a-b| <= tol*max(1,|a|,|b|)"})

    def __post_init__(self):
        super().__post_init__()
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.num_tolerance < 0:
            raise ValueError(f"num_tolerance must be >= 0, got {self.num_tolerance}")


@dataclass(kw_only=True)
class RolloutConfig(ArmsConfig):
    """Settings of a closed-loop run (the flags of ``eogym-sft rollout``); ``max_episode_tokens`` is an episode's
    token budget, image tokens included (the KV cache holds ``slots`` x ``max_episode_tokens`` tokens)."""

    max_episode_tokens: int = field(
        default=MAX_EPISODE_TOKENS,
        metadata={"aliases": ["--max-length"],
                  "help": "tokens per episode, images included (the KV cache holds --slots x this)"}
    )
    tools: list[str] = field(
        default_factory=lambda: list(DEFAULT_BACKENDS),
        metadata={"type": comma_list,
                  "help": "tool backends, first that answers wins (comma-separated: crop,replay,http)"},
    )
    tool_url: str | None = field(default=None, metadata={"help": "URL of a running tool server for the http backend "
                                                                 "(docs/environment.md)"})
    ks: list[int] | None = field(
        default=None,
        metadata={"flag": "--pass-k", "metavar": "K", "help": "report Pass@k for these k (default: 1 and --samples)"}
    )
    max_turns: int = field(default=8, metadata={"help": "assistant turns per episode"})
    slots: int | None = field(
        default=None,
        metadata={"help": "episodes decoded at once (default: as many as the GPU holds beside the model, a prefill "
                          f"and the merged LoRA weights, at most one per episode; {CPU_SLOTS} off CUDA)"},
    )
    cuda_graphs: bool = field(
        default=True,
        metadata={"help": "replay the decode step from CUDA graphs on a GPU (--no-cuda-graphs: run it eagerly)"}
    )
    judge_url: str | None = field(
        default=None,
        metadata={"help": "OpenAI-compatible chat-completions URL for an LLM judge (key: $OPENAI_API_KEY)"}
    )
    judge_model: str = field(default=DEFAULT_JUDGE_MODEL, metadata={"help": "model name sent to --judge-url"})
    judge_retries: int = field(default=ChatJudge.retries,
                               metadata={"help": "retries of a failed judge request before it is counted"})
    judge_timeout: float = field(default=ChatJudge.timeout,
                                 metadata={"help": "seconds for judging one answer, retries included"})
    # arms behind chat-completions servers: built from --policy-url/--policy-model/--policy-config
    policies: list[PolicyServer] = field(default_factory=list, metadata={"flag": False})

    def has_arms(self) -> bool:
        return super().has_arms() or bool(self.policies)

    def __post_init__(self):
        super().__post_init__()
        if min(self.max_turns, 1 if self.slots is None else self.slots, self.max_episode_tokens) < 1:
            raise ValueError("max_turns, slots and max_episode_tokens must be at least 1")
        self.ks = sorted(set(self.ks or [1, self.samples]))
        if self.ks[0] < 1 or self.ks[-1] > self.samples:
            raise ValueError(f"Pass@k needs 1 <= k <= samples ({self.samples}), got k in {self.ks}")
        if self.judge and self.judge_url:
            raise ValueError("give --judge or --judge-url, not both")
        if self.judge_url:  # a URL, timeout or retries the judge refuses is refused now, before run.json is written
            ChatJudge(self.judge_url, self.judge_model, timeout=self.judge_timeout, retries=self.judge_retries)
        unknown = set(self.tools) - set(BACKENDS)
        if unknown:
            raise ValueError(f"--tools: unknown backend(s) {sorted(unknown)}; known: {', '.join(BACKENDS)}")
        if "http" in self.tools and not self.tool_url:
            raise ValueError("--tools http needs --tool-url (the tool server's URL)")
        if self.tool_url:
            check_url(self.tool_url)


@dataclass(kw_only=True)
class ValidateConfig(SampleConfig):
    """Settings of ``eogym-sft validate``."""

    model: str = field(metadata={"help": "base model: hub id or local folder"})
    adapters: list[str] = field(default_factory=list, metadata=ADAPTERS)  # "DIR" or "NAME=DIR", one arm each
    include_base: bool = field(default=True, metadata=NO_BASE)
    data: str = field(metadata={"help": "prepared folder, or EO-Gym JSONL (prepared on the way in)"})
    data_root: str = field(default=".", metadata=DATA_ROOT)
    output: str = field(metadata={"help": "report.json to write"})
    batch_size: int | None = field(
        default=None,
        metadata={"help": f"samples packed into one forward (default: the most, up to {VALIDATE_BATCHES[0]}, whose "
                          f"largest batch the GPU holds beside the model; {CPU_BATCH} off CUDA)"},
    )
    num_proc: int = field(default=1, metadata={"help": "data-prep workers when --data is JSONL"})
    device: str = field(default="auto", metadata=DEVICE)
    dtype: str = field(default="auto", metadata=DTYPE)
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "text attention: eogym_varlen_cudnn (default on CUDA, the recipe's), eogym_varlen (default "
                          "elsewhere) or sdpa (padded batches)"},
    )
    # Processes that collate batches (decode, resize and patchify images) while the model runs.
    dataloader_workers: int = field(
        default=8,
        metadata={"help": "processes that collate batches while the model runs (at most CPUs - 1; 0: the main "
                          "process)"}
    )
    # On CUDA, where it pays, not on CPU, where Inductor's compile takes longer than a small run.
    compile_layers: bool | None = field(
        default=None, metadata={"help": "compile the decoder layers as the SFT recipe does (default: on CUDA only)"}
    )
    allow_other_base: bool = field(default=False, metadata={"help": "use an adapter trained on a base of another name "
                                                                    "(the same weights renamed)"})
    held_out_fraction: float | None = field(
        default=None,
        metadata={"help": "score only the traces a training run held out: its eval_fraction (with --seed, its seed)",
                  "max": 1.0}
    )
    seed: int = field(default=42, metadata={"help": "the training run's seed, for --held-out-fraction"})
    overwrite: bool = field(default=False, metadata={"help": "write into a non-empty --output (refused otherwise)"})

    def __post_init__(self):
        super().__post_init__()
        if not self.include_base and not self.adapters:
            raise ValueError("nothing to score: no base arm and no adapters")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.dataloader_workers < 0:
            raise ValueError("dataloader_workers must be 0 or more")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.held_out_fraction is not None and not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")


# ---------------------------------------------------------------- command line


def add_validate_args(parser) -> None:
    """The flags of ``eogym-sft validate``: one per :class:`ValidateConfig` field."""
    add_dataclass_args(parser, ValidateConfig)


def add_evaluate_args(parser) -> None:
    """The flags of ``eogym-sft evaluate``: one per :class:`EvalConfig` field, and ``--no-progress``."""
    add_dataclass_args(parser, EvalConfig)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_rollout_args(parser) -> None:
    """The flags of ``eogym-sft rollout``: one per :class:`RolloutConfig` field, ``--no-progress``, and the policy
    servers' flags, which build ``RolloutConfig.policies``."""
    add_dataclass_args(parser, RolloutConfig)
    add = parser.add_argument
    add("--no-progress", action="store_true", help="no progress bar")
    add("--policy-url", action="append", default=[], metavar="URL",
        help="an OpenAI-compatible chat-completions endpoint as one more arm (repeat for several; docs/evaluation.md)")
    add("--policy-model", action="append", default=[], metavar="[ARM=]MODEL",
        help="the model name sent to the i-th --policy-url")
    add("--policy-config", action="append", default=[], metavar="JSON",
        help="settings of the policy servers as a JSON object or file: api_key_env, concurrency, deadline_s, retries, "
             "max_response_bytes, tool_images_as, max_tokens_field, body (one for all, or one per --policy-url)")


def refuse_foreign_adapters(adapters: list[str], model: str, allow_other_base: bool) -> None:
    """Each ``--adapter [NAME=]DIR`` is a PEFT folder trained on ``model``, checked before anything loads
    (:func:`eogym_sft.models.loading.parse_arms` checks again as it builds the arms)."""
    for spec in adapters:
        _, sep, path = spec.partition("=")
        check_adapter_base(path if sep else spec, model, allow_other_base)


def refuse_missing_inputs(paths: list[str], command: str) -> None:
    """A ``--data`` file that is not there stops ``command`` before anything is loaded or written."""
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{command}: no such data file: {path}")


def refuse_taken_run_folder(out: str, overwrite: bool, command: str) -> None:
    """A non-empty ``out`` that holds no run to continue (no ``run.json``) is refused before anything loads;
    whether a run that is there has the same settings is :func:`eogym_sft.evaluation.resume.open_run`'s to say."""
    from .resume import RUN_FILE

    if overwrite or not (Path(out) / RUN_FILE).is_file():
        check_output(out, command, overwrite, "rollout")


def arm_inputs(data, adapters: list[str]) -> list[str]:
    """What a run reads and its output may not land on: the data files and each ``[NAME=]DIR`` adapter folder."""
    return [*data, *(spec.partition("=")[2] or spec for spec in adapters)]


def is_validation_report(path: Path) -> bool:
    """Whether ``path`` is a report an earlier ``validate`` wrote (a JSON object with ``models``), which
    ``--overwrite`` may replace wherever it is."""
    from ..safe_json import UntrustedJSONError, loads

    try:
        if path.stat().st_size > 64 * 2**20:
            return False
        value = loads(path.read_bytes())
    except (OSError, UntrustedJSONError):
        return False
    return isinstance(value, dict) and isinstance(value.get("models"), dict)


def check_validate_output(cfg: ValidateConfig) -> None:
    """:func:`eogym_sft.guards.check_output` for ``validate``'s report."""
    data = [p for p in cfg.data.split(",") if p]
    check_output(cfg.output, "eogym-sft validate", cfg.overwrite, "validation report", arm_inputs(data, cfg.adapters),
                 is_validation_report)


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
