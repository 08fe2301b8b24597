"""Tool calls and reasoning parsed out of a model's reply, in the formats llama.cpp's ``common/chat`` reads.

:func:`chat_format` reads a chat template and returns the :class:`ChatFormat` of its model family;
:meth:`ChatFormat.parse` splits a whole reply into a :class:`Reply` (content, reasoning,
:class:`ToolCall` list), :meth:`ChatFormat.stream` gives a :class:`ReplyStream` that does the same
incrementally (text that may still become markup is held back, never emitted and retracted), and
:meth:`ChatFormat.tool_grammar` an llguidance Lark grammar that forces a tool call for
``tool_choice="required"`` or a named function.

Families (see :data:`ggmlpy.chat.detect.RULES` for the detection order): Hermes/Qwen
``<tool_call>`` JSON, Qwen3-Coder XML (and Seed-OSS), GLM 4.5, MiniMax M2, Llama 3.x JSON,
Functionary v3.1 and v3.2, Mistral ``[TOOL_CALLS]`` (Nemo, Small 3.2, Ministral/Devstral),
DeepSeek R1 and V3.1, Kimi K2, Command-R7B/Cohere2, gpt-oss harmony, and the generic format.

Examples
--------
>>> from ggmlpy.chat import chat_format
>>> fmt = chat_format("{{ '[TOOL_CALLS]' }}")
>>> call, = fmt.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}').tool_calls
>>> call.name, call.arguments, call.arguments_json
('get_weather', {'city': 'Paris'}, '{"city": "Paris"}')
"""

from __future__ import annotations

from ._bodies import MAX_JSON_DEPTH
from .detect import chat_format
from .formats import ChatFormat
from .stream import ReplyStream
from .types import Reply, ReplyDelta, ToolCall, ToolCallDelta

__all__ = ["MAX_JSON_DEPTH", "ChatFormat", "Reply", "ReplyDelta", "ReplyStream", "ToolCall", "ToolCallDelta",
           "chat_format"]
