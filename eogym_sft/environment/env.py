"""An EO-Gym tool environment: executes a model's tool calls for one row, as rollouts and GRPO need.

>>> env = EOGymEnvironment(row, "eogym_sft/sample")                     # doctest: +SKIP
>>> result = env.call("crop_optical_or_sar_image", {"image_url": row["images"][0], "aoi": [0.25, 0.25, 0.75, 0.75]})
>>> result.text, result.images, result.message()                     # doctest: +SKIP

Backends form a chain; the first that can answer wins: ``crop`` (:mod:`eogym_sft.environment.backends.crop`),
``replay`` (:mod:`eogym_sft.environment.backends.replay`), ``http`` (:mod:`eogym_sft.environment.backends.http`), or
any object with a ``name`` and ``answer(tool, arguments) -> (text, images or None)``. Images come from the tool-image
rule of :mod:`eogym_sft.data.tool_images` applied to the result text (replay: the recorded turn's images, chosen by
the same rule), so a result shows the model exactly what data prep shows it. A model's mistake (an
unknown tool, bad arguments, a call no backend answers) is an error message back to the model and a
count in ``counts``, never an exception; so are the calls of one turn past ``max_calls_per_turn``
(:meth:`EOGymEnvironment.call_turn`), which are not run. ``docs/environment.md`` has the details.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from ..config import TOOL_IMAGES
from ..data.images import ImageError, checked_image_size, resolve_image_path
from ..data.tool_images import ToolImageRule
from ..data.traces import TraceError, normalize_tools, parse_arguments
from ..net import quoted, short
from ..safe_json import UntrustedJSONError, loads
from .backends.crop import CropBackend
from .backends.http import HttpBackend, HttpToolServer
from .backends.replay import ReplayBackend
from .results import CannotAnswer, ToolCallError, ToolResult

BACKENDS = ("crop", "replay", "http")
# a tool text longer than this is cut, with a note saying so: it is context the model pays for
MAX_TOOL_TEXT_CHARS = 32768
# Calls run from one model turn; the rest are not run and the model is told. EO-Gym's traces make one to three
# calls a turn; a 2.9 MB reply once asked for 20,000 crops.
MAX_CALLS_PER_TURN = 8
# The one result of a turn's calls past the cap; evaluation reads it back to tell run calls from skipped ones.
SKIPPED_CALLS_NOTICE = (
    "Error: {calls} tool calls in one turn; only the first {cap} were run, the other {skipped} were not."
)
DEFAULT_BACKENDS = ("crop", "replay")  # offline: computed crops, the rest answered from the row's own trace
JSON_TYPES = {
    "string": str,
    "number": (int, float),
    "integer": int,
    "boolean": bool,
    "array": list,
    "object": dict,
    "null": type(None),
}


def check_arguments(schema: dict, arguments: dict) -> str | None:
    """Why ``arguments`` do not fit a tool's JSON-schema ``parameters`` (required keys, declared types), or None."""
    props = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    if schema.get("additionalProperties") is False and set(arguments) - set(props):
        return f"unknown argument(s): {short(', '.join(sorted(set(arguments) - set(props))), 120)}"
    for key, value in arguments.items():
        kinds = (props.get(key) or {}).get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds or []
        types = tuple(t for k in kinds for t in (JSON_TYPES.get(k),) if t)
        bool_ok = "boolean" in kinds  # bool is an int in Python, not a number in JSON
        if types and (not isinstance(value, types) or (isinstance(value, bool) and not bool_ok)):
            return f"argument {short(key, 40)!r} must be {' or '.join(kinds)}, got {quoted(value)}"
    return None


class EOGymEnvironment:
    """Runs one row's tool calls; see the module docstring.

    ``row`` is a raw EO-Gym row (possibly question-only); ``tools`` are its normalised schemas, the ones
    the ``# Tools`` block renders. ``cache_dir`` (default ``<data_root>/image_cache/crops``) must lie
    inside ``data_root``, so that episodes naming crops can be prepared with the same data root.
    ``http`` is an :class:`HttpToolServer` or its URL; ``attach`` a :class:`ToolImageRule` or its spec.
    """

    def __init__(
        self,
        row: dict,
        data_root: str | os.PathLike,
        backends=DEFAULT_BACKENDS,
        *,
        cache_dir: str | os.PathLike | None = None,
        http: HttpToolServer | str | None = None,
        attach: ToolImageRule | str | None = None,
        replay_tolerance: float = 0.01,
        max_tool_text_chars: int = MAX_TOOL_TEXT_CHARS,
        max_calls_per_turn: int = MAX_CALLS_PER_TURN,
    ):
        if isinstance(max_calls_per_turn, bool) or not isinstance(max_calls_per_turn, int) or max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be a whole number >= 1, got {max_calls_per_turn!r}")
        self.row = row
        self.data_root = Path(data_root).resolve()
        self.tools = normalize_tools(row.get("tools"))
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}
        self.rule = ToolImageRule.parse(TOOL_IMAGES if attach is None else attach)
        cache = Path(cache_dir).resolve() if cache_dir is not None else self.data_root / "image_cache" / "crops"
        if not cache.is_relative_to(self.data_root):
            raise ValueError(f"cache_dir {cache} must lie inside the data root {self.data_root}")
        self.backends = [self._backend(b, cache, http, replay_tolerance) for b in backends]
        self.max_tool_text_chars = max_tool_text_chars
        self.max_calls_per_turn = max_calls_per_turn
        self.counts: Counter = Counter()

    def _backend(self, spec, cache: Path, http, tolerance: float):
        if not isinstance(spec, str):
            return spec  # a user's own backend object
        if spec == "crop":
            images = self.row.get("images")
            only = images[0] if isinstance(images, list) and len(images) == 1 and isinstance(images[0], str) else None
            return CropBackend(self.data_root, cache, default_image=only)
        if spec == "replay":
            return ReplayBackend(self.row, self.rule, tolerance)
        if spec == "http":
            if http is None:
                raise ValueError("the http backend needs http= (a tool server URL or an HttpToolServer)")
            server = HttpToolServer(http) if isinstance(http, str) else http
            return HttpBackend(server, str(self.row.get("id")))
        raise ValueError(f"unknown backend {spec!r}: choose from {', '.join(BACKENDS)}")

    def call(self, name: str, arguments: dict | str) -> ToolResult:
        """Execute one call; every failure is a ``ToolResult`` with ``ok=False``."""
        self.counts["calls"] += 1
        args, backend = {}, None
        try:
            args = self._arguments(name, arguments)
            backend, text, images = self._answer(name, args)
            result = ToolResult(name, args, self._capped(text), self._resolve(images), True, backend)
        except ToolCallError as err:
            self.counts["errors"] += 1
            self.counts[f"error:{err.code}"] += 1
            return ToolResult(name, args, f"Error: {err.message}", [], False, backend or err.backend, err.code)
        self.counts[f"backend:{backend}"] += 1
        return result

    def call_turn(self, calls: list[dict]) -> list[ToolResult]:
        """Execute one model turn's ``calls`` (``{"name", "arguments"}`` each), at most ``max_calls_per_turn``
        of them. The rest are not run: one last result (``ok=False``, error ``too_many_calls``) tells the model,
        and ``counts["skipped_calls"]`` counts them."""
        cap = self.max_calls_per_turn
        results = [self.call(c["name"], c["arguments"]) for c in calls[:cap]]
        skipped = len(calls) - cap
        if skipped > 0:
            self.counts["skipped_calls"] += skipped
            text = SKIPPED_CALLS_NOTICE.format(calls=len(calls), cap=cap, skipped=skipped)
            results.append(ToolResult("", {}, text, [], False, None, "too_many_calls"))
        return results

    def _capped(self, text: str) -> str:
        if len(text) <= self.max_tool_text_chars:
            return text
        self.counts["truncated_results"] += 1
        cut = len(text) - self.max_tool_text_chars
        return f"{text[: self.max_tool_text_chars]}\n[result truncated: {cut} more characters]"

    def _arguments(self, name: str, arguments) -> dict:
        if name not in self.schemas:
            known = ", ".join(self.schemas) or "none"
            raise ToolCallError("unknown_tool", f"unknown tool {short(str(name), 80)!r}; the tools are: {known}")
        try:
            args = parse_arguments(arguments, "arguments")
        except TraceError as err:
            raise ToolCallError("bad_arguments", f"arguments of {name}: {err.detail}") from None
        problem = check_arguments(self.schemas[name], args)
        if problem:
            raise ToolCallError("bad_arguments", f"{name}: {problem}")
        return args

    def _answer(self, name: str, args: dict) -> tuple[str, str, list[str]]:
        reasons = []
        for backend in self.backends:
            try:
                text, images = backend.answer(name, args)
            except CannotAnswer as why:
                reasons.append(f"{backend.name}: {why}")
                continue
            except ToolCallError as err:
                err.backend = backend.name
                raise
            return backend.name, text, self.rule.images(name, text) if images is None else images
        raise ToolCallError("no_backend", f"{name} cannot be run here ({'; '.join(reasons) or 'no backends'})")

    def _resolve(self, images: list[str]) -> list[str]:
        """Absolute paths of a result's images; each must be a readable image under the data root."""
        out = []
        for rel in images:
            try:
                path = resolve_image_path(rel, self.data_root)
                checked_image_size(path)  # what data prep requires of an image: the whole file decodes
            except ImageError as err:
                message = f"the result names image {short(rel, 120)}, which cannot be shown ({err.reason})"
                raise ToolCallError("bad_image", message) from None
            out.append(str(path))
        return out


def find_row(path: str | os.PathLike, row_id: str) -> dict:
    """The row with id ``row_id`` in an EO-Gym JSONL file (lines that are not JSON are skipped)."""
    with open(path, encoding="utf-8-sig", errors="replace") as fh:
        for line in fh:
            try:
                row = loads(line)
            except UntrustedJSONError:
                continue
            if isinstance(row, dict) and str(row.get("id")) == row_id:
                return row
    raise ValueError(f"no row with id {row_id!r} in {path}")


def single_call(
    data_root: str | os.PathLike,
    name: str,
    arguments: dict | str,
    backends=("crop",),
    row: dict | None = None,
    **env_args,
) -> ToolResult:
    """Run one call by hand (``eogym-sft tool-call``). Without a row, ``name`` is the only tool and its
    arguments are not checked against a schema (the backend still checks what it needs)."""
    if row is None:
        row = {"id": "tool-call",
               "tools": [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]}
    return EOGymEnvironment(row, data_root, backends, **env_args).call(name, arguments)
