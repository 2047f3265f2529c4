"""JSON from outside the library (input rows, tool-call arguments, server replies), parsed without surprises.

``json.loads`` can raise more than ``JSONDecodeError`` on hostile text: ``RecursionError`` for deep
nesting and ``ValueError`` for integers past Python's digit limit; and a value that parses at depth 900
can still blow the stack of a later recursive walk (``strip_none``, the chat template's ``tojson``).
:func:`loads` turns all of these into one :class:`UntrustedJSONError` with a stable ``reason``, and
refuses nesting deeper than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

import json

MAX_DEPTH = 64  # EO-Gym rows nest about 6 deep; 64 leaves room and stays far below the interpreter's stack


class UntrustedJSONError(ValueError):
    """Text that is not acceptable JSON; ``reason`` is ``malformed_json``, ``json_too_deep`` or
    ``json_number_too_long``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def depth(value) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), walked without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in item if isinstance(child, (dict, list)))
    return deepest


def loads(text: str | bytes, max_depth: int = MAX_DEPTH):
    """``json.loads(text)``, or :class:`UntrustedJSONError` for any text it cannot take safely."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UntrustedJSONError("malformed_json", f"{err.msg} at column {err.colno}") from None
    except RecursionError:
        raise UntrustedJSONError("json_too_deep",
                                 f"nested deeper than the parser can go (limit {max_depth})") from None
    except UnicodeDecodeError as err:  # bytes given
        raise UntrustedJSONError("malformed_json", f"invalid UTF-8 at byte {err.start}") from None
    except ValueError as err:  # int digit limit: "Exceeds the limit (4300 digits) for integer string conversion"
        raise UntrustedJSONError("json_number_too_long", str(err).split(";")[0]) from None
    if depth(value) > max_depth:
        raise UntrustedJSONError("json_too_deep", f"nested more than {max_depth} levels deep")
    return value


def loads_object(text: str | bytes, where: str, what: str) -> dict:
    """The JSON object ``text`` holds, parsed by :func:`loads`; anything else is a one-line ``ValueError`` naming
    ``where`` it came from (a file, a flag) and ``what`` it should be."""
    try:
        value = loads(text)
    except UntrustedJSONError as err:
        raise ValueError(f"{where}: not {what} ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: not {what} (a JSON object expected, got {type(value).__name__})")
    return value


def record_line(record) -> str:
    """One JSONL line of ``record``: ASCII only (``ensure_ascii``), so a lone surrogate (``"\\ud800"``, valid
    JSON) or a line separator (U+2028, U+0085) in a server's text cannot fail the write or split the line for
    a reader; every reader splits on ``b"\\n"`` alone (:func:`jsonl_lines`) and reads back the same value."""
    return json.dumps(record, ensure_ascii=True) + "\n"


def jsonl_lines(data: bytes):
    """``(line number, line bytes)`` of JSONL ``data``, split on ``b"\\n"`` only (never on the other line
    breaks ``str.splitlines`` knows); blank lines are left out, a missing last newline is allowed."""
    for number, line in enumerate(data.split(b"\n"), 1):
        if line.strip():
            yield number, line
