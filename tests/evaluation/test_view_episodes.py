"""Episodes as ``eogym-sft view``'s page shows them (eogym_sft/evaluation/view_episodes.py); whole pages are tested
in test_view.py."""

from __future__ import annotations

import json

from eogym_sft.evaluation.view_episodes import gold_view


def test_the_gold_view_counts_the_matched_prefix_of_the_calls_the_tools_ran():
    def turn(name, arguments, result="ok"):
        call = {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": result}]

    gold = [{"name": "crop", "arguments": {"aoi": [0, 0, 0.5, 0.5]}}, {"name": "crop", "arguments": {"aoi": [0.5, 0.5, 1, 1]}},
            {"name": "count", "arguments": {"label": "car"}}]
    messages = [{"role": "user", "content": "q"}, *turn("crop", {"aoi": [0, 0, 0.5, 0.5]}), *turn("crop", {"aoi": [0.5, 0.5, 1, 0.95]}),
                *turn("count", {"label": "cars"}), {"role": "assistant", "content": "Final Answer: 2"}]
    view = gold_view(gold, messages)
    assert (view["exact"], view["aoi"], view["names"]) == (1, 2, 3)
    assert view["gold"][0] == {"n": "crop", "a": '{"aoi": [0, 0, 0.5, 0.5]}'} and view["ran"][2] == {"n": "count", "a": '{"label": "cars"}'}
    assert gold_view(None, messages) is None and gold_view([{"name": "x", "arguments": "text"}], messages) is None
    junk = ["not a message", {"role": "assistant", "tool_calls": ["junk"]}, {"role": "tool", "content": "ok"}]
    assert gold_view(gold, junk)["ran"] == [{"n": "None", "a": "null"}]
