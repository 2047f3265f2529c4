"""What one tool call gives back to the model, and the two ways a backend declines or fails a call."""

from __future__ import annotations

from dataclasses import asdict, dataclass


class ToolCallError(Exception):
    """A call that ends in an error message for the model; ``code`` is a stable reason
    (``unknown_tool``, ``bad_arguments``, ``no_backend``, ``http_error``, ``bad_image``, ``tool_failed``)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
        self.backend: str | None = None  # set by the environment to the backend that failed the call


class CannotAnswer(Exception):
    """A backend that cannot answer this call; the next backend in the chain may."""


@dataclass
class ToolResult:
    """One executed tool call (see ``docs/environment.md``)."""

    name: str
    arguments: dict
    text: str  # the tool message text: the result (JSON text, shaped like the traces') or an error message
    images: list[str]  # absolute paths of the images attached to the tool message, in order
    ok: bool
    backend: str | None  # the backend that answered or failed the call: "crop" | "replay" | "http"; None if none did
    error: str | None = None  # a ToolCallError code when not ok

    def message(self) -> dict:
        """The tool turn as :func:`eogym_sft.data.traces.normalize_row` writes it: text, then one image part per
        image."""
        return {"role": "tool",
                "content": [{"type": "text", "text": self.text}] + [{"type": "image"} for _ in self.images]}

    def to_dict(self) -> dict:
        return asdict(self)
