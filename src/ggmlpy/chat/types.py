"""What a parsed reply holds: :class:`ToolCall`, :class:`Reply`, and the streaming :class:`ReplyDelta`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Optional

__all__ = ["Reply", "ReplyDelta", "ToolCall", "ToolCallDelta"]

_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def arguments_json(arguments: Any) -> str:
    """``arguments`` as the JSON text OpenAI's ``function.arguments`` carries (non-ASCII kept)."""
    return json.dumps(arguments, ensure_ascii=False)


def generated_id(index: int, name: str, arguments: Any) -> str:
    """The id of a call whose format carries none: ``call_`` and nine alphanumerics.

    Derived from the call's position in the reply, its name and its arguments, so that parsing
    the same text twice (or streaming it in any chunks) gives the same ids, and two calls of one
    reply never share one. Nine alphanumerics because Mistral's templates accept only ids of that
    shape when the conversation is rendered again.
    """
    digest = hashlib.sha256(f"{index}\0{name}\0{arguments_json(arguments)}".encode()).digest()
    n = int.from_bytes(digest[:8], "big")
    chars = []
    for _ in range(9):
        n, r = divmod(n, len(_ALNUM))
        chars.append(_ALNUM[r])
    return "call_" + "".join(chars)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call the model made.

    Attributes
    ----------
    id : str
        The model's own id where the format carries one (Mistral's nine alphanumerics, Command-R's
        ``tool_call_id``, Kimi K2's ``functions.<name>:<index>``), else :func:`generated_id`'s
        ``call_`` plus nine alphanumerics, deterministic for the reply.
    name : str
        The function's name.
    arguments : Any
        The arguments as parsed JSON, usually a dict.
    """

    id: str
    name: str
    arguments: Any

    @property
    def arguments_json(self) -> str:
        """The arguments as a JSON string (OpenAI's ``function.arguments``)."""
        return arguments_json(self.arguments)

    def to_openai(self) -> dict:
        """The call in OpenAI's ``tool_calls`` shape."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclasses.dataclass
class Reply:
    """A model's reply split into its parts.

    Attributes
    ----------
    content : str
        The text meant for the user, without reasoning or tool-call markup; leading and trailing
        whitespace removed (templates put newlines around their tags).
    reasoning : str or None
        The reasoning (a think block, gpt-oss's analysis channel...), stripped likewise; None when
        the reply has none (or an empty one).
    tool_calls : list of ToolCall
        The calls, in order.
    """

    content: str = ""
    reasoning: Optional[str] = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A tool call's part of a streamed :class:`ReplyDelta` (OpenAI's streaming shape).

    The first delta of call ``index`` carries its ``id`` and ``name``; ``arguments`` fragments
    joined in order are the call's arguments as JSON text. Here a call is emitted once it is
    complete, so a call arrives as one delta carrying all three.
    """

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


@dataclasses.dataclass(frozen=True)
class ReplyDelta:
    """What one :meth:`ReplyStream.feed` step adds: content text, reasoning text, or a tool call."""

    content: str = ""
    reasoning: str = ""
    tool_call: Optional[ToolCallDelta] = None
