"""``EOGymCollator``: Qwen3-VL batches with assistant-only labels, padded or padding-free.

Third-party imports are torch and transformers only (plus Pillow through ``eogym_sft.data.images``), so
other projects can use it on their own data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from transformers import ProcessorMixin

from ..config import SampleConfig
from ..models.host_layout import HostLayout, VisionGeometry
from ..models.layout import expand_image_pads_and_mask, grid_token_counts, mrope_position_ids
from .encoding import encode_conversation
from .images import ImageError, load_rgb, resolve_image_path, to_rgb8


@dataclass
class EOGymCollator:
    r"""Collate EO-Gym samples (or any conversational image examples) into Qwen3-VL model inputs.

    Each example is either a prepared sample from ``eogym-sft prepare`` (``input_ids``,
    ``assistant_masks``, ``images``, ``image_hw``), or a plain conversational example in TRL's shape:
    ``messages`` (list or JSON string), ``images`` (paths or PIL images, in the order of the
    ``{"type": "image"}`` parts) and optional ``tools`` (OpenAI function schemas). Plain examples are
    rendered with the processor's chat template and ``tools=``.

    Labels are the token ids on assistant content, tool calls and the closing ``<|im_end|>``, and
    ``-100`` everywhere else (system, tools block, user, tool results, image tokens, padding). Images are
    resized by the processor's image processor with its own pixel cap (``image_processor.size``:
    ``longest_edge`` is the most pixels an image keeps, ``shortest_edge`` the fewest). The processor is the one
    carrier of that cap, shared by data prep, training and evaluation: give it one with
    :func:`eogym_sft.models.processor.load_processor` (``max_pixels=``, ``min_pixels=``; 1,003,520 px, 980
    visual tokens, by default). A sample over ``max_length`` tokens is an error: truncating would cut images
    apart; split it with data prep.

    Args:
        processor (`ProcessorMixin`): a Qwen3-VL processor (tokenizer, image processor with its pixel cap,
            chat template).
        data_root (`str`, *optional*): folder that relative image paths are resolved under (and may not
            leave). If `None`, paths are opened as given.
        max_length (`int`, *optional*): longest sample allowed, image tokens included (`None`: no limit).
        padding_free (`bool`, *optional*, defaults to `False`): pack the batch into one row, with
            per-sample position ids instead of an attention mask.
        pad_to_multiple_of (`int`, *optional*): pad the padded batch's length to a multiple of this.
        skip_bad_images (`bool`, *optional*, defaults to `False`): an example whose image cannot be used
            (missing, undecodable, or resized otherwise than data prep planned: the file changed after prep)
            is left out of the batch instead of raising, and listed in the batch's ``skipped_samples``.
            A batch whose every example is skipped holds one untrained padding token, so that every
            rank still runs its step. Pop ``skipped_samples`` before calling the model.
        pixel_dtype (`torch.dtype`, *optional*): dtype of the returned ``pixel_values`` (`None`: the
            processor's float32). Qwen3-VL's vision tower casts them to its own dtype before anything else, so
            that dtype (bfloat16 in the recipe) gives the model the same values at half the bytes to concatenate,
            pass between the dataloader's processes, pin and copy to the GPU.
        host_layout (`bool`, *optional*, defaults to `False`): add ``host_layout``, a
            :class:`~eogym_sft.models.host_layout.HostLayout`: what the forward would otherwise read back from the GPU
            (supervised positions, the samples' boundaries, the images' grid), computed here on the host.
            :class:`~eogym_sft.training.trainer.EOGymSFTTrainer` feeds it to the model; pop it before calling the
            model yourself. The SFT recipe turns it on.
        vision (`VisionGeometry`, *optional*): the model's vision tower settings
            (``VisionGeometry.of(model)``); with ``host_layout``, the layout carries the tower's metadata too
            (rotary positions, position-grid interpolation, attention boundaries), so it reads nothing back.

    Returns a dict with ``input_ids``, ``labels``, ``position_ids`` (``[4, batch, length]``),
    ``pixel_values`` and ``image_grid_thw`` (when there are images), ``attention_mask`` (padded mode),
    ``mm_token_type_ids`` (when the processor produces them), with ``host_layout`` ``host_layout`` and, with
    ``skip_bad_images``, ``skipped_samples``: ``[{"index", "sample_id", "file", "reason", "detail"}]``.

    Example:

    >>> from PIL import Image
    >>> from eogym_sft import EOGymCollator
    >>> from eogym_sft.models.tiny import build_offline_processor
    >>> collator = EOGymCollator(build_offline_processor())
    >>> example = {
    ...     "messages": [
    ...         {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count the ships."}]},
    ...         {"role": "assistant", "content": "Final Answer: 3"},
    ...     ],
    ...     "images": [Image.new("RGB", (320, 256))],
    ... }
    >>> batch = collator([example])
    >>> batch["image_grid_thw"].tolist()  # 320x256 px -> 16x20 patches -> 8x10 = 80 visual tokens
    [[1, 16, 20]]
    >>> collator.processor.tokenizer.decode(batch["labels"][batch["labels"] != -100])
    'Final Answer: 3<|im_end|>'
    """

    processor: ProcessorMixin
    data_root: str | None = None
    max_length: int | None = SampleConfig.max_length
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    ignore_index: int = -100
    skip_bad_images: bool = False
    pixel_dtype: torch.dtype | None = None
    host_layout: bool = False
    vision: VisionGeometry | None = None

    def __post_init__(self):
        tokenizer = self.processor.tokenizer
        self.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.merge_size = self.processor.image_processor.merge_size
        self.with_token_types = "mm_token_type_ids" in self.processor.model_input_names

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        rows, skipped = [], []
        for k, example in enumerate(examples):
            try:
                rows.append(self._encode(example, k))
            except ImageError as err:
                if not self.skip_bad_images:
                    raise
                skipped.append({"index": k, "sample_id": self._name(example, k), "file": err.path,
                                "reason": err.reason, "detail": err.detail})
        batch = (
            self._pack(rows or [self._empty_row()]) if self.padding_free else self._pad(rows or [self._empty_row()])
        )
        grids = [r["image_grid_thw"] for r in rows if r["image_grid_thw"] is not None]
        if grids:
            batch["pixel_values"] = torch.cat([r["pixel_values"] for r in rows if r["pixel_values"] is not None])
            batch["image_grid_thw"] = torch.cat(grids)
        if self.host_layout:
            batch["host_layout"] = HostLayout.of_batch(
                batch["labels"], batch["position_ids"], batch.get("image_grid_thw"), self.vision, self.ignore_index
            )
        if self.skip_bad_images:
            batch["skipped_samples"] = skipped
        return batch

    def _empty_row(self) -> dict:
        """One padding token with no label: a forward and backward that change nothing."""
        ids = torch.tensor([self.pad_token_id])
        positions = torch.zeros(4, 1, dtype=torch.long)
        return {"input_ids": ids, "labels": torch.tensor([self.ignore_index]), "position_ids": positions,
                "pixel_values": None, "image_grid_thw": None}

    def _name(self, example: dict, k: int) -> str:
        return str(example.get("sample_id") or example.get("id") or f"example {k} of the batch")

    def _token_layout(self, example: dict) -> tuple[list[int], list[int]]:
        """Unexpanded token ids (one ``<|image_pad|>`` per image) and the 0/1 trained mask."""
        if "input_ids" in example and "assistant_masks" in example:
            return list(example["input_ids"]), list(example["assistant_masks"])
        messages = example["messages"]
        messages = json.loads(messages) if isinstance(messages, str) else messages
        tools = example.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        enc = encode_conversation(self.processor, messages, tools)
        return enc.input_ids, enc.assistant_mask

    def _load_image(self, image, name: str):
        if not isinstance(image, str):
            return to_rgb8(image)
        try:
            return load_rgb(resolve_image_path(image, self.data_root) if self.data_root else image)
        except ImageError as err:
            raise ImageError(err.reason, err.path, f"{err.detail} (sample {name})") from None

    def _encode(self, example: dict, k: int) -> dict:
        name = self._name(example, k)
        ids, mask = self._token_layout(example)
        images = [self._load_image(im, name) for im in example.get("images") or []]
        n_pads = sum(1 for t in ids if t == self.image_token_id)
        if n_pads != len(images):
            raise ValueError(f"{name}: {n_pads} image placeholders in the text but {len(images)} images")
        pixel_values = grid = None
        counts: list[int] = []
        if images:
            # No size= here: the image processor resizes with its own size, the cap data prep planned with.
            out = self.processor.image_processor(images=images, return_tensors="pt")
            pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
            if self.pixel_dtype is not None:  # per sample: the batch's concatenation then moves half the bytes
                pixel_values = pixel_values.to(self.pixel_dtype)
            counts = grid_token_counts(grid, self.merge_size)
            self._check_prepared_sizes(example, grid, name)
        input_ids, trained = expand_image_pads_and_mask(ids, mask, counts, self.image_token_id)
        if self.max_length is not None and len(input_ids) > self.max_length:
            raise ValueError(
                f"{name}: {len(input_ids)} tokens is over max_length={self.max_length}; truncating would cut images "
                "or turns apart. Run `eogym-sft prepare` (it splits long traces at assistant turns)."
            )
        input_ids = torch.tensor(input_ids, dtype=torch.long)
        n_image_tokens = int((input_ids == self.image_token_id).sum())
        if grid is not None and n_image_tokens != sum(counts):
            raise ValueError(f"{name}: {n_image_tokens} image tokens but image_grid_thw gives {sum(counts)}")
        empty_grid = torch.zeros(0, 3, dtype=torch.long)
        positions = mrope_position_ids(input_ids, grid if grid is not None else empty_grid, self.image_token_id,
                                       self.merge_size)
        return {
            "input_ids": input_ids,
            "labels": input_ids.masked_fill(~torch.tensor(trained, dtype=torch.bool), self.ignore_index),
            "position_ids": positions,
            "pixel_values": pixel_values,
            "image_grid_thw": grid,
        }

    def _check_prepared_sizes(self, example: dict, grid: torch.Tensor, name: str) -> None:
        """Prepared samples carry their resized sizes; the processor must agree (same pixel cap)."""
        expected = example.get("image_hw")
        if expected is None:
            return
        image_processor = self.processor.image_processor
        patch, size = image_processor.patch_size, image_processor.size
        got = [[h * patch, w * patch] for _, h, w in grid.tolist()]
        if got != [list(hw) for hw in expected]:
            # ImageError (a ValueError): with skip_bad_images, an image file changed since prep is skipped.
            raise ImageError(
                "image_changed",
                ", ".join(map(str, example.get("images") or [])),
                f"{name}: images resize to {got} but data prep planned {list(map(list, expected))}: the processor's "
                f"pixel cap (max_pixels={size['longest_edge']}, min_pixels={size['shortest_edge']}) differs from "
                "prep's, or the files changed since prep; give the processor prep's cap with "
                "eogym_sft.models.processor.load_processor(model, max_pixels=..., min_pixels=...)",
            )

    def _token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (input_ids == self.image_token_id).to(torch.int32)

    def _pad(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        length = max(r["input_ids"].shape[0] for r in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(rows)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, length), self.ignore_index, dtype=torch.long)
        attention_mask = torch.zeros((batch, length), dtype=torch.long)
        position_ids = torch.zeros((4, batch, length), dtype=torch.long)
        for b, row in enumerate(rows):
            n = row["input_ids"].shape[0]
            input_ids[b, :n] = row["input_ids"]
            labels[b, :n] = row["labels"]
            attention_mask[b, :n] = 1
            position_ids[:, b, :n] = row["position_ids"]
        out = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
               "position_ids": position_ids}
        if self.with_token_types:
            out["mm_token_type_ids"] = self._token_types(input_ids)
        return out

    def _pack(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        input_ids = torch.cat([r["input_ids"] for r in rows])[None]
        labels = torch.cat([r["labels"] for r in rows])
        # A sample's first token must not be predicted from the previous sample's last one.
        starts = torch.tensor([0] + [r["input_ids"].shape[0] for r in rows[:-1]]).cumsum(0)
        labels[starts] = self.ignore_index
        out = {
            "input_ids": input_ids,
            "labels": labels[None],
            "position_ids": torch.cat([r["position_ids"] for r in rows], dim=1)[:, None],
        }
        if self.with_token_types:
            out["mm_token_type_ids"] = self._token_types(input_ids)
        return out
