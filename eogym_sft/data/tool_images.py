"""Which images a tool result shows the model: one rule, per tool, shared by data prep and the environment.

A tool result's text can name image files. Some of them the tool *produced* for the model to look at
(a crop, an index preview: ``image_cache/...`` paths, a ``cropped_path`` field); others it only *lists*
(``get_optical_image_list`` returns co-located frames "without analyze content": ``EO_GYM_DATA/...``
paths the model may crop or open with a later call). A mode says which named paths become image parts:

* ``produced`` (default): paths under ``image_cache/`` and the path of a ``cropped_path`` field;
* ``attach``: every named ``EO_GYM_DATA/`` or ``image_cache/`` image path (data prep's old behaviour);
* ``text``: none; the paths stay text only.

A spec is the default mode, then optional per-tool overrides: ``"produced,get_sar_image=attach"``.
Pure Python: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..config import TOOL_IMAGES

TOOL_IMAGE_MODES = ("produced", "attach", "text")
# Tool results name their outputs with the dataset's portable prefixes; an absolute prefix in front
# of them (a tool server's cache dir) is ignored, and `..` is rejected later by the path check.
TOOL_IMAGE_PATH_RE = re.compile(
    r"(?:EO_GYM_DATA|image_cache)/[^\s\"'<>,;()\[\]{}]+?\.(?:jpe?g|png|tiff?|webp|bmp)\b", re.IGNORECASE
)
CROPPED_PATH_RE = re.compile(r"[\"']?cropped_path[\"']?\s*[:=]\s*[\"']([^\"']+)[\"']")


@dataclass(frozen=True)
class ToolImageRule:
    """The attach mode for each tool name (``per_tool``), else ``default``."""

    default: str = TOOL_IMAGES
    per_tool: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        for name, mode in [("<default>", self.default), *self.per_tool.items()]:
            if mode not in TOOL_IMAGE_MODES:
                raise ValueError(f"tool image mode for {name} must be one of {', '.join(TOOL_IMAGE_MODES)}, got "
                                 f"{mode!r}")

    @classmethod
    def parse(cls, spec: str | ToolImageRule) -> ToolImageRule:
        """``"MODE[,TOOL=MODE...]"`` -> a rule; a rule passes through unchanged."""
        if isinstance(spec, ToolImageRule):
            return spec
        default, per_tool = TOOL_IMAGES, {}
        for item in (part.strip() for part in str(spec).split(",")):
            if "=" in item:
                name, mode = (s.strip() for s in item.split("=", 1))
                if not name:
                    raise ValueError(f"tool image spec {spec!r}: an override needs a tool name before '='")
                per_tool[name] = mode
            elif item:
                default = item
        return cls(default, per_tool)

    def mode(self, tool: str | None) -> str:
        return self.per_tool.get(tool, self.default) if tool else self.default

    def images(self, tool: str | None, text: str) -> list[str]:
        """The image paths ``text`` (a result of ``tool``) attaches, distinct, in order of appearance."""
        mode = self.mode(tool)
        if mode == "text":
            return []
        named = list(dict.fromkeys(m.group(0) for m in TOOL_IMAGE_PATH_RE.finditer(text)))
        if mode == "attach":
            return named
        cropped = {m.group(0) for c in CROPPED_PATH_RE.finditer(text) for m in TOOL_IMAGE_PATH_RE.finditer(c.group(1))}
        return [p for p in named if p.lower().startswith("image_cache/") or p in cropped]
