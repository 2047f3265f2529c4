"""GRPO after SFT: TRL's ``GRPOTrainer`` with ``environment_factory`` over :class:`EOGymEnvironment`.

The model sees what SFT showed it. The prompt is the row's system prompt and question (its images
included) normalised by :func:`eogym_sft.data.traces.normalize_row`; the ``# Tools`` block is the row's own
tool schemas, not schemas TRL derives from Python signatures; tool results come back as the tool turns
of data prep (the result text, then the images the tool produced, under the processor's pixel cap).

How the row's schemas reach the prompt. TRL renders each prompt with the tools of the environment that
the example's ``environment`` column selects (a ``{name: factory}`` ``environment_factory``). Rows are
grouped by their tool schemas: the group key is the ``environment`` column, and after the trainer is
built :func:`show_row_tools` replaces each group's rendered tools (TRL's private ``_env_tools``, pinned by
``tests/training/test_grpo.py``) with the group's JSON schemas. The tool calls themselves run through public
methods of one environment class built for the dataset's tool names (:func:`environment_class`).

The examples are read by :mod:`.grpo_data`; the episodes come from one of two engines, TRL's own loop
(:mod:`.grpo_trl`) or the slot decoder (:mod:`.grpo_slots`).
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import GRPOTrainer

from ..config import TOOL_IMAGES, TOOL_IMAGES_HELP, ImageConfig, OutputDirConfig
from ..data.images import ImageError, load_rgb
from ..environment.env import DEFAULT_BACKENDS
from ..metrics.judge import DEFAULT_JUDGE_MODEL, ChatJudge
from ..models.attention import NAMES as VARLEN_NAMES
from ..models.tiny import qwen3_vl_chat_template
from ..models.processor import images_processed_once
from ..agent.rollout_config import SlotRolloutArguments
from . import grpo_slots
from .grpo_data import EpisodeData, episode_dataset, load_episodes
from .grpo_mismatch import mismatch
from .grpo_trl import GenerationProgress, TRLEngine, with_logits_processors
from .packed_logps import loss_batch, pack_rows, packed_logps_and_entropies
from .rewards import EpisodeReward

logger = logging.getLogger(__name__)


@dataclass
class GRPOScriptArguments(SlotRolloutArguments, ImageConfig, OutputDirConfig):
    """Data, environment and reward settings of an EO-Gym GRPO run; images as in SFT (:class:`ImageConfig`,
    crops included); how episodes are generated (:class:`~eogym_sft.agent.rollout_config.SlotRolloutArguments`);
    the rest are TRL's ``GRPOConfig`` and ``ModelConfig``."""

    dataset_path: str = field(
        default="data/eo_gym/train.jsonl",
        metadata={"help": "EO-Gym JSONL: questions with gt_answer (gold trajectories optional)"},
    )
    data_root: str = field(default="data/eo_gym", metadata={"help": "folder holding EO_GYM_DATA/ and image_cache/"})
    sft_adapter: str | None = field(
        default=None,
        metadata={"help": "LoRA adapter from the SFT recipe to train further (default: a new adapter on the base "
                          "model)"},
    )
    tool_backends: str = field(
        default=",".join(DEFAULT_BACKENDS),
        metadata={"help": "environment backends, first that can answer wins: crop, replay, http"},
    )
    crop_cache_dir: str | None = field(
        default=None,
        metadata={"help": "where crops are written, inside data_root (default: <data_root>/image_cache/crops)"},
    )
    tool_images: str = field(default=TOOL_IMAGES, metadata={"help": TOOL_IMAGES_HELP})
    tool_call_cost: float = field(default=EpisodeReward.tool_call_cost,
                                  metadata={"help": "cost of one tool call, invalid ones included"})
    action_cost_scale: float = field(
        default=EpisodeReward.action_cost_scale,
        metadata={"help": "reward = score x (1 - min(calls x tool_call_cost x action_cost_scale, max_cost_penalty))"},
    )
    max_cost_penalty: float = field(
        default=EpisodeReward.max_cost_penalty,
        metadata={"help": "largest share of the score the action cost may take"},
    )
    crop_iou_weight: float = field(
        default=EpisodeReward.crop_iou_weight,
        metadata={"help": "reward += crop_iou_weight x the mean IoU of the episode's best box per gold call with a "
                          "box (the row's own trace): argument quality, not only the answer; 0: off"},
    )
    judge: str | None = field(
        default=None,
        metadata={"help": "module:function judge(question, prediction, reference) -> bool (default: normalised "
                          "match)"},
    )
    judge_url: str | None = field(
        default=None,
        metadata={"help": "OpenAI-compatible chat-completions URL of an LLM judge (key: $OPENAI_API_KEY), as in "
                          "rollout"},
    )
    judge_model: str = field(default=DEFAULT_JUDGE_MODEL, metadata={"help": "model name sent to judge_url"})
    judge_timeout: float = field(default=ChatJudge.timeout,
                                 metadata={"help": "seconds for judging one answer at judge_url, retries included"})
    judge_retries: int = field(default=ChatJudge.retries, metadata={"help": "retries of a failed judge_url request "
                                                                            "before the answer counts as unjudged"})
    limit: int | None = field(default=None, metadata={"help": "use the first N usable rows only"})
    progress_seconds: float = field(
        default=30.0,
        metadata={"help": "log generation progress (tokens, tokens/s) at most this often while episodes are "
                          "generated"},
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("tool_call_cost", "action_cost_scale", "max_cost_penalty", "crop_iou_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_cost_penalty > 1:
            raise ValueError(f"max_cost_penalty must be <= 1, got {self.max_cost_penalty}")
        if self.judge and self.judge_url:
            raise ValueError("give judge or judge_url, not both")
        limit_bad = self.limit is not None and self.limit < 1
        if min(self.progress_seconds, self.judge_timeout) <= 0 or self.judge_retries < 0 or limit_bad:
            raise ValueError("need progress_seconds, judge_timeout > 0, judge_retries >= 0, limit >= 1 (or None); got "
                             f"{self.progress_seconds}, {self.judge_timeout}, {self.judge_retries}, {self.limit}")

    def load_judge(self):
        """The answer judge these settings name, or None for the normalised match."""
        from ..metrics.judge import ChatJudge, load_judge

        if self.judge_url:
            return ChatJudge(self.judge_url, self.judge_model, timeout=self.judge_timeout, retries=self.judge_retries)
        return load_judge(self.judge) if self.judge else None


################
# The environment TRL drives
################


class EOGymToolEnvironment:
    """One closed-loop episode for TRL: ``reset(**example)`` starts it on the example's row, and each tool
    the dataset names is a method (added by :func:`environment_class`) that runs the call in
    :class:`~eogym_sft.environment.env.EOGymEnvironment` and returns the tool turn as content blocks.

    ``tool_calls`` and ``tool_errors`` count the calls the environment ran and those it answered with an error.
    """

    _settings: dict = {}  # keyword arguments of EOGymEnvironment beside the row, set by environment_class

    def reset(self, row: str, **example) -> None:
        from ..environment.env import EOGymEnvironment

        self._env = EOGymEnvironment(json.loads(row), **self._settings)
        self.tool_calls = 0
        self.tool_errors = 0
        return None  # the prompt is the dataset's

    def _call(self, name: str, arguments: dict) -> list[dict]:
        result = self._env.call(name, arguments)
        self.tool_calls += 1
        self.tool_errors += not result.ok
        blocks = [{"type": "text", "text": result.text}]
        for path in result.images:
            try:
                blocks.append({"type": "image", "image": load_rgb(path)})
            except ImageError as err:  # a crop that does not decode: the model is told, the run goes on
                self.tool_errors += 1
                blocks.append({"type": "text", "text": f"\n(image not available: {err.reason})"})
        return blocks


def _tool_method(name: str):
    def tool(self, **arguments):
        return self._call(name, arguments)

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = f"Run the EO-Gym tool {name!r}; its schema is the row's own (see eogym_sft.training.grpo)."
    return tool


def environment_class(tool_names: list[str], data_root: str | Path, backends=DEFAULT_BACKENDS, **env_kwargs) -> type:
    """An :class:`EOGymToolEnvironment` subclass with one method per tool name.

    TRL executes a call by looking up a public method of the environment's class by the tool's name. A call
    to a tool outside the row's own list still reaches :class:`EOGymEnvironment`, which answers it with
    its ``unknown_tool`` error, as in ``eogym-sft rollout``.
    """
    methods = {name: _tool_method(name) for name in tool_names}
    settings = {"data_root": data_root, "backends": tuple(backends), **env_kwargs}
    return type("EOGymTools", (EOGymToolEnvironment,), {**methods, "_settings": settings})


def show_row_tools(trainer, schemas: dict[str, list[dict]]) -> None:
    """Render each ``environment`` group's prompts with its rows' own JSON tool schemas.

    TRL keeps the tools it renders per environment name in ``trainer._env_tools`` (methods, turned into
    schemas from their signatures); JSON schemas are what ``apply_chat_template(tools=...)`` renders
    as they are. ``parse_response`` also types call arguments from these schemas.
    """
    env_tools = getattr(trainer, "_env_tools", None)
    if not isinstance(env_tools, dict) or set(env_tools) != set(schemas):
        raise RuntimeError(
            "this TRL version does not keep per-environment tools in GRPOTrainer._env_tools; "
            "eogym_sft.training.grpo.show_row_tools needs updating (tests/training/test_grpo.py pins the behaviour)"
        )
    for name, tools in schemas.items():
        env_tools[name] = tools


def check_chat_template(processor) -> None:
    """TRL parses tool calls only under chat templates it knows: for Qwen3-VL, its own copy."""
    if processor.chat_template != qwen3_vl_chat_template():
        raise ValueError(
            "GRPO with tools needs the processor's chat template to equal TRL's Qwen3-VL template "
            "(trl/chat_templates/qwen3_vl.jinja), which TRL parses tool calls under; set "
            "processor.chat_template = eogym_sft.models.tiny.qwen3_vl_chat_template() if yours renders the same turns"
        )



class EOGymGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose episodes come from ``engine``: :class:`TRLEngine` (TRL's own loop) or
    :class:`~eogym_sft.training.grpo_slots.SlotEngine` (the slot decoder; its loss forward packs a micro-batch's
    episodes into one row, :mod:`eogym_sft.training.packed_logps`).

    TRL's private methods overridden (no public hook sees them), each pinned by a test:

    * ``_generate(prompts)``: the engine's episodes, in TRL's 8-tuple return layout
      (``tests/training/test_grpo_slots.py::test_both_engines_hand_the_loss_the_same_batch``, and
      ``tests/training/test_grpo.py``'s CPU steps on mixed and truncated batches);
    * ``_generate_and_score_completions(inputs)``: wrapped to hand the engine each example's row (the same tests);
    * ``_compute_loss`` and ``_get_per_token_logps_and_entropies``: the packed loss forward, slots engine only
      (``tests/training/test_packed_logps.py``, against TRL's padded forward).

    ``_env_tools`` is read and written after the trainer is built (:func:`show_row_tools`, pinned in test_grpo.py).
    """

    def __init__(self, *args, engine, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = engine
        self._inputs: list[dict] | None = None
        self._loss_mask = None
        self._loss_logps: list | None = None  # inside _compute_loss: the loss forward's log-probs (the mismatch log)
        engine.bind(self)

    def _generate(self, prompts):
        return self.engine.generate(self, prompts, self._inputs)

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's turn, with the log-probability of each token sampled without vLLM (TRL keeps none there)."""
        ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        recorder = getattr(self.engine, "generated", None)
        if logprobs is None and recorder is not None:
            logprobs = recorder.lists([len(c) for c in ids])
        return ids, logprobs

    def _generate_and_score_completions(self, inputs):
        self._inputs = inputs  # the slots engine needs each example's row, not only its prompt
        try:
            # TRL patches every episode's images in one call (a question's episodes share its prompt's images), and
            # its scoring re-enables checkpointing in every layer
            with images_processed_once(self.processing_class), checkpointing_kept(self.model):
                return super()._generate_and_score_completions(inputs)
        finally:
            self._inputs = None

    def _compute_loss(self, model, inputs):
        """TRL's loss, its forward scoring only the tokens the loss counts
        (:func:`~eogym_sft.training.packed_logps.loss_batch`)."""
        if self.engine.packed_loss:
            inputs, self._loss_mask = loss_batch(inputs)
        self._loss_logps = []
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._loss_mask = None
        self._log_mismatch(inputs, self._loss_logps[0] if self._loss_logps else None)
        self._loss_logps = None
        return loss

    def _log_mismatch(self, inputs, loss_logps) -> None:
        """``rollout/logp_abs_diff`` and ``rollout/k3_kl`` of the batch (:mod:`~eogym_sft.training.grpo_mismatch`)."""
        rollout = inputs.get("sampling_per_token_logps")
        train = inputs.get("old_per_token_logps")
        train = loss_logps if train is None else train
        if rollout is None or train is None:
            return
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        found = mismatch(train, rollout, mask)
        if found is not None:
            metrics = self._metrics["train" if self.model.training else "eval"]
            metrics["rollout/logp_abs_diff"].append(found["abs_diff"])
            metrics["rollout/k3_kl"].append(found["k3"])

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, mm_token_type_ids=None,
        **other,
    ):
        """TRL's per-token log-probabilities (same arguments, same ``(rows, logits_to_keep)`` result) on packed
        episodes: each chunk of ``batch_size`` rows is one packed row (:mod:`eogym_sft.training.packed_logps`).
        Overrides TRL's private method, pinned by ``tests/training/test_packed_logps.py``; TRL's own forward
        under an engine without ``packed_loss``."""
        if not self.engine.packed_loss:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                pixel_values=pixel_values, image_grid_thw=image_grid_thw, num_images=num_images,
                mm_token_type_ids=mm_token_type_ids, **other,
            )
            return self._kept_for_mismatch(out)
        given = sorted(k for k, v in other.items() if v is not None)
        if given:
            raise ValueError(f"the packed loss forward takes Qwen-style vision inputs only, not {given}")
        image_processor = self.processing_class.image_processor
        batch_size = batch_size or input_ids.size(0)
        score_mask = self._loss_mask
        if score_mask is not None and score_mask.shape != (input_ids.size(0), logits_to_keep):
            score_mask = None  # not the loss's own batch: score every completion token
        # Only our attentions read the shared-prompt layout (SDPA would let the episodes see each other)
        share_prompts = grpo_slots.text_attention_of(self.accelerator.unwrap_model(model)) in VARLEN_NAMES
        logps, entropies, aux = [], [], []
        first_image = 0
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            images = num_images[start:end] if num_images is not None else None
            grid, pixels = None, None
            if image_grid_thw is not None and pixel_values is not None:
                grid = image_grid_thw[first_image:first_image + sum(images)]
                rows_before = int(image_grid_thw[:first_image].prod(-1).sum())
                pixels = pixel_values[rows_before:rows_before + int(grid.prod(-1).sum())]
                first_image += sum(images)
            packed = pack_rows(
                input_ids[start:end], attention_mask[start:end], logits_to_keep,
                self._tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                image_processor.merge_size, pixels, grid, images,
                None if mm_token_type_ids is None else mm_token_type_ids[start:end],
                None if score_mask is None else score_mask[start:end],
                share_prompts=share_prompts,
            )
            lp, ent, aux_loss = packed_logps_and_entropies(
                model, packed, end - start, logits_to_keep, compute_entropy, compute_aux_loss,
                self.accelerator.autocast
            )
            logps.append(lp)
            entropies.append(ent)
            aux.append(aux_loss)
        return self._kept_for_mismatch((
            torch.cat(logps),
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux).mean() if compute_aux_loss else None,
        ))

    def _kept_for_mismatch(self, out):
        if getattr(self, "_loss_logps", None) is not None:  # inside _compute_loss: the loss forward's own
            self._loss_logps.append(out[0])
        return out


@contextmanager
def checkpointing_kept(model):
    """Each module's activation checkpointing as it was before the block, whatever the block switched.

    TRL 1.16 scores a step's episodes inside ``disable_gradient_checkpointing``, which turns checkpointing back on
    with ``args.gradient_checkpointing_kwargs`` alone: every layer checkpointed again, and transformers'
    ``every_n_layers`` (a key of ``activation_checkpointing_kwargs``) handed on to each layer's forward. Pinned by
    ``tests/training/test_grpo.py::test_trl_turns_checkpointing_back_on_in_every_layer``."""
    held = [(m, m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None))
            for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    try:
        yield
    finally:
        for module, enabled, func in held:
            module.gradient_checkpointing = enabled
            if func is not None:
                module._gradient_checkpointing_func = func


################
# The trainer
################


def build_trainer(model, processor, data: EpisodeData, script_args: GRPOScriptArguments, training_args, judge=None,
                  logits_processors=()):
    """:class:`EOGymGRPOTrainer` over the episodes in ``data``, with the EO-Gym environment and episode reward; its
    episodes generated by ``script_args.rollout_engine`` (``slots``:
    :class:`~eogym_sft.training.grpo_slots.SlotEngine`, ``trl``: :class:`TRLEngine`).

    ``model`` is the LoRA-wrapped policy; ``judge`` an optional ``judge(question, prediction, reference)``;
    ``logits_processors`` (transformers-style) act on every sampling step of either engine.
    """
    from transformers import LogitsProcessorList

    from ..models.attention import NAMES as VARLEN_NAMES
    from ..agent.sampling import vision_token_ids
    from .grpo_slots import SlotEngine, text_attention_of

    check_chat_template(processor)
    env_class = environment_class(
        data.tool_names, script_args.data_root, script_args.tool_backends.split(","),
        cache_dir=script_args.crop_cache_dir, attach=script_args.tool_images,
    )
    tokenizer = processor.tokenizer
    reward = EpisodeReward(
        training_args.num_generations,
        tool_call_cost=script_args.tool_call_cost,
        action_cost_scale=script_args.action_cost_scale,
        max_cost_penalty=script_args.max_cost_penalty,
        judge=judge,
        crop_iou_weight=script_args.crop_iou_weight,
        eos_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id, tokenizer.pad_token_id),
    )
    if not training_args.use_vllm:
        # TRL suppresses only <|image_pad|>; a sampled <|video_pad|> or <|vision_start|> breaks the training
        # forward's 3-D positions (seen with random weights), so every vision token is suppressed.
        kwargs = dict(training_args.generation_kwargs or {})
        kwargs["suppress_tokens"] = sorted(set(kwargs.get("suppress_tokens", [])) | set(vision_token_ids(tokenizer)))
        training_args.generation_kwargs = kwargs
    text_attention = text_attention_of(model)
    if script_args.rollout_engine == "trl" and text_attention in VARLEN_NAMES:
        raise ValueError(
            f"rollout_engine=trl generates with TRL's padded generate, which attn_implementation={text_attention} "
            "cannot run (no KV cache): set --attn_implementation sdpa, or use --rollout_engine slots"
        )
    if script_args.rollout_engine == "slots":
        engine = SlotEngine(script_args, logits_processors)
    else:
        engine = TRLEngine(GenerationProgress(script_args.progress_seconds))
        if logits_processors:
            model.generate = with_logits_processors(model.generate, LogitsProcessorList(logits_processors))
    trainer = EOGymGRPOTrainer(
        engine=engine,
        model=model,
        reward_funcs=[reward],
        args=training_args,
        train_dataset=episode_dataset(data, script_args.data_root, images=script_args.rollout_engine == "trl"),
        processing_class=processor,
        environment_factory={name: env_class for name in data.schemas},
    )
    show_row_tools(trainer, data.schemas)
    return trainer


def check_sft_adapter(adapter_dir: str, model: str) -> None:
    """Refuse an ``--sft_adapter`` recorded for another base than ``--model_name_or_path`` (as ``rollout`` does),
    before anything is loaded: LoRA deltas trained on other weights load without error and train nonsense."""
    from ..guards import adapter_base, same_base

    trained_on = adapter_base(adapter_dir)
    if trained_on and not same_base(trained_on, model):
        raise ValueError(
            f"--sft_adapter {adapter_dir} was trained on {trained_on!r} but --model_name_or_path is {model!r}: "
            "pass the base it was trained on"
        )


def train(script_args: GRPOScriptArguments, training_args, model_args) -> str:
    """GRPO from ``--sft_adapter`` (trained further) or a new LoRA adapter on the base model; save the
    adapter, its processor and ``eogym_run.json`` to ``output_dir`` and return that folder."""
    from transformers.trainer_utils import enable_full_determinism, set_seed

    from ..data.datasets import file_sha256
    from ..models.loading import apply_lora, continue_lora, load_base_model
    from ..models.processor import load_processor
    from ..quiet import grpo_quietly
    from .resume import CheckpointIdentity, claim_output_dir, finished, resume_point
    from .run_info import save_run

    logging.basicConfig(level=logging.INFO if training_args.process_index == 0 else logging.WARNING)
    if not model_args.use_peft:
        raise ValueError("this recipe trains LoRA adapters: set use_peft: true")
    if script_args.sft_adapter:
        check_sft_adapter(script_args.sft_adapter, model_args.model_name_or_path)
    claim_output_dir(training_args, script_args.overwrite_output_dir)
    processor = load_processor(model_args.model_name_or_path, script_args.max_pixels, script_args.min_pixels)
    data = load_episodes(script_args.dataset_path, script_args.data_root, script_args.limit)
    stats = {"content_hash": file_sha256(script_args.dataset_path), **data.stats()}
    stats.update(samples_out=len(data.records), rows_dropped=sum(data.skipped.values()))
    # Resume only a complete checkpoint of this same run (configs and data hash), as the SFT recipe does.
    configs = {"script": script_args, "training": training_args, "model": model_args}
    identity, checkpoint = resume_point(training_args, configs, stats["content_hash"])
    if checkpoint is not None and finished(checkpoint):
        return training_args.output_dir

    # A new adapter's A matrices are drawn when it is added, before the Trainer seeds anything.
    (enable_full_determinism if training_args.full_determinism else set_seed)(training_args.seed)
    model = load_base_model(model_args.model_name_or_path, model_args.dtype, model_args.attn_implementation)
    if script_args.sft_adapter:
        model = continue_lora(model, script_args.sft_adapter)
    else:
        model = apply_lora(model, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout,
                           model_args.lora_target_modules)
    with grpo_quietly():
        trainer = build_trainer(model, processor, data, script_args, training_args, script_args.load_judge())
        trainer.add_callback(CheckpointIdentity(identity))
        trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))

    output_dir = save_run(trainer, processor, configs, stats)
    logger.info("adapter saved to %s", output_dir)
    return output_dir
