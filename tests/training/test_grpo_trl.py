"""TRL's generation output settled before the loss (eogym_sft/training/grpo_trl.py); the engine's CPU steps are
in test_grpo.py."""

from __future__ import annotations

from helpers import IM_END

from eogym_sft.training.grpo_trl import Completions, cut_for_length, settle_completions

PAD = 151643
IM_PAD = 151655  # <|image_pad|>


def _completions(messages, ids, tool_images, images):
    return Completions(
        [list(i) for i in ids], [[1] * len(i) for i in ids], None, messages, images, tool_images,
    )


def test_settle_completions_marks_cut_episodes_and_strips_masked_images():
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "crop", "arguments": {}}}]}
    tool = {"role": "tool", "content": "ok"}
    answer = {"role": "assistant", "content": "Final Answer: 3"}
    messages = [[call], [call, tool, call], [call, tool, answer], [call, tool, {"role": "assistant", "content": "I see"}]]
    ids = [[5, IM_END], [5, 7, 5, IM_END], [5, 7, 8, IM_END], [5, 7, IM_PAD, IM_PAD, 9]]
    out = _completions(messages, ids, [[], ["crop"], ["crop"], ["crop1", "crop2"]], [None, ["scene"], None, ["scene", "crop1", "crop2"]])
    truncated = settle_completions(out, eos_ids=[IM_END], pad_id=PAD, image_token_id=IM_PAD, mask_truncated=True, max_tool_iterations=1)
    # 0: its only tool result was dropped (cut); 1: the tool-round limit (1 round) ended it, not the length
    assert truncated == [0, 3]
    assert out.completion_ids == [[5], [5, 7, 5, IM_END], [5, 7, 8, IM_END], [5, 7, PAD, PAD, 9]]
    assert out.tool_mask[0] == [1]
    assert out.images == [[], ["scene"], [], ["scene"]] and out.tool_images[3] == []
    assert out.tool_images[1] == ["crop"]  # an episode that ended properly keeps its images
    unmasked = _completions(messages[3:], ids[3:], [["crop1", "crop2"]], [["scene", "crop1", "crop2"]])
    settle_completions(unmasked, [IM_END], PAD, IM_PAD, mask_truncated=False, max_tool_iterations=2)
    assert unmasked.images == [["scene", "crop1", "crop2"]] and unmasked.completion_ids == ids[3:]
    none = _completions([[answer]], [[8, IM_END]], [[]], [None])
    settle_completions(none, [IM_END], PAD, IM_PAD, mask_truncated=True, max_tool_iterations=2)
    assert none.images is None  # no image anywhere: TRL's text-only path


def test_cut_for_length_needs_a_pending_call_before_the_round_limit():
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "crop"}}]}
    tool = {"role": "tool", "content": "ok"}
    assert cut_for_length([call], max_tool_iterations=1)
    assert not cut_for_length([call, tool, call], max_tool_iterations=1)
    assert not cut_for_length([call, tool, {"role": "assistant", "content": "Final Answer: 1"}], max_tool_iterations=3)
    assert not cut_for_length([], max_tool_iterations=3)
