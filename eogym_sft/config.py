"""The recipe's own arguments; the rest are TRL's ``SFTConfig`` and ``ModelConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EOGymScriptArguments:
    """Data and image settings of an EO-Gym SFT run."""

    dataset_path: str = field(
        default="data/eo_gym/train.jsonl",
        metadata={"help": "a folder made by `eogym-sft prepare`, or EO-Gym JSONL (comma-separated for several), prepared on the way in"},
    )
    data_root: str = field(default="data/eo_gym", metadata={"help": "folder holding EO_GYM_DATA/ and image_cache/"})
    prepared_dir: str | None = field(
        default=None, metadata={"help": "where JSONL input is prepared to (default: <output_dir>/prepared); reused when settings match"}
    )
    eval_fraction: float = field(default=0.02, metadata={"help": "share of traces held out for evaluation, split by trace id"})
    max_pixels: int = field(default=1003520, metadata={"help": "pixel cap per image: 980 visual tokens on Qwen3-VL"})
    min_pixels: int = field(default=65536, metadata={"help": "pixel floor per image (Qwen3-VL's processor default)"})
    overlong: str = field(default="split", metadata={"help": "over-long traces: split (at assistant turns) or drop"})
    tool_images: str = field(
        default="produced",
        metadata={"help": "which tool-result images the model sees: produced, attach or text, then TOOL=MODE overrides (docs/data.md)"},
    )
    prep_num_proc: int = field(default=8, metadata={"help": "data-prep worker processes"})
    pack_batch: bool = field(
        default=False,
        metadata={"help": "padding-free: pack each batch into one row with per-sample mRoPE position ids (TRL's own padding_free refuses image data)"},
    )
    compile_layers: bool = field(
        default=False,
        metadata={"help": "regional torch.compile of each language-model decoder layer (GPU; compiles during the first steps)"},
    )

    def __post_init__(self):
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
