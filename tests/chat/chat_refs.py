"""Reference replies for the chat parsers: llama.cpp's real templates, rendered by ggmlpy's renderer.

For each template, a conversation [system, user, assistant with a tool call (+ reasoning, content)]
is rendered with and without its last turn; what the assistant turn adds after the generation
prompt, cut at the end-of-turn marker, is the reply the model would have written.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for hf_convert
import hf_convert  # noqa: E402

from ggmlpy.chat import chat_format  # noqa: E402
from ggmlpy.tokenizer.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
                "days": {"type": "integer", "description": "Forecast days"},
            },
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER_TOOL]
#: nine alphanumerics: the Mistral templates refuse any other tool call id
CALL_ID = "aB3dE6gH9"
ARGS = {"city": "Paris", "unit": "celsius", "days": 3}
CONTENT = "Let me check."
REASONING = "I should call the tool."
#: what the templates end an assistant turn with (gpt-oss's <|end|> separates its messages: not here)
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<｜end▁of▁sentence｜>", "<|END_OF_TURN_TOKEN|>",
               "<|end_of_text|>", "[e~[", "<|return|>", "<seed:eos>", "<|end|>\n", "<sep>", "<|role_end|>",
               "</assistant>")
TEMPLATE_VARS = {"functions": "[]", "datetime": "2024-07-26", "enable_thinking": True}


@functools.cache
def sources() -> dict[str, str]:
    return hf_convert.chat_templates()


def _assistant(content: str, reasoning: bool, string_args: bool) -> dict:
    args = json.dumps(ARGS) if string_args else dict(ARGS)
    msg = {"role": "assistant", "content": content,
           "tool_calls": [{"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": args}}]}
    if reasoning:
        msg["reasoning_content"] = REASONING
    return msg


BASE = [{"role": "system", "content": "Use the tools when needed."},
        {"role": "user", "content": "What's the weather in Paris?"}]


def _render(t: ChatTemplate, messages, gen: bool) -> str:
    return t.render(messages, tools=TOOLS, add_generation_prompt=gen, **TEMPLATE_VARS)


def reference(name: str):
    """(reply text, the format, the assistant message rendered) for template ``name``, or None when
    no variant of the conversation renders."""
    src = sources()[name]
    t = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    fmt = chat_format(src, tools=TOOLS, **{k: v for k, v in TEMPLATE_VARS.items() if k != "enable_thinking"})
    for content, reasoning, string_args in ((CONTENT, True, False), ("", True, False), (CONTENT, False, False),
                                            (CONTENT, False, True), ("", False, True)):
        msg = _assistant(content, reasoning, string_args)
        try:
            full = _render(t, BASE + [msg], False)
            prompt = _render(t, BASE, True)
            pre = _render(t, BASE, False)
        except ChatTemplateError:
            continue
        if not full.startswith(pre):
            continue
        reply, gen = full[len(pre):], prompt[len(pre):]
        k = 0
        while k < min(len(gen), len(reply)) and gen[k] == reply[k]:
            k += 1
        while k and gen[k - 1] not in ">\n":     # cut after the last whole marker of the header
            k -= 1
        reply = reply[k:]
        cut = [reply.find(m) for m in END_OF_TURN if m in reply]
        reply = reply[:min(cut)] if cut else reply
        if fmt.thinking_forced_open and not gen[:k].rstrip().endswith(fmt.reasoning_tags[0]):
            reply = fmt.reasoning_tags[1] + reply     # the prompt opened a block the render left out
        return reply, fmt, msg
    return None


_KIMI = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
         '<|tool_call_argument_begin|>{"city": "Paris", "unit": "celsius", "days": 3}<|tool_call_end|>'
         "<|tool_calls_section_end|>")
#: replies for templates that do not render here: Kimi K2's mutate lists (the sandbox refuses; the reply is
#: moonshotai-Kimi-K2's, which renders); Mistral Nemo's renders the tools in the turn before the call,
#: so the conversation with the call is no extension of the one without (its turn as it renders it)
HAND_REFERENCES = {
    "Kimi-K2-Instruct": _KIMI,
    "Kimi-K2-Thinking": "<think>I should call the tool.</think>" + _KIMI,
    "mistralai-Mistral-Nemo-Instruct-2407":
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}, '
        '"id": "aB3dE6gH9"}]',
}


def copy_args() -> dict:
    return copy.deepcopy(ARGS)
