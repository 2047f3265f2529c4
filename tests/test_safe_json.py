"""JSON from outside parsed safely (eogym_sft/safe_json.py): a JSON object or one line naming where it came from."""

from __future__ import annotations

import pytest

from eogym_sft.safe_json import loads_object


def test_loads_object_gives_the_object_or_names_where_and_what():
    assert loads_object(b'{"a": [1]}', "f.json", "a config") == {"a": [1]}
    with pytest.raises(ValueError, match=r"^f.json: not a config \(malformed_json: Expecting value at column 7\)$"):
        loads_object('{"a": }', "f.json", "a config")
    with pytest.raises(ValueError, match=r"^--flag: not a config \(a JSON object expected, got list\)$"):
        loads_object("[1]", "--flag", "a config")
    with pytest.raises(ValueError, match=r"^--flag: not a config \(json_too_deep: "):
        loads_object("[" * 100 + "]" * 100, "--flag", "a config")
