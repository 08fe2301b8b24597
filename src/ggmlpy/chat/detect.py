"""Which format a chat template's model writes, read from the template's text as llama.cpp does.

llama.cpp's ``common/chat`` recognises a family by substrings of its template (``<|channel|>`` is
gpt-oss, ``>>>all`` Functionary v3.2, ``[TOOL_CALLS]`` Mistral...); the families it leaves to its
template-diffing autoparser are recognised here by their tool-call markup too. The first rule that
matches wins, in :data:`RULES`' order; a template that matches none gets the generic format.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ggmlpy._core import GGMLTypeError

from .families import (
    CommandR,
    DeepSeek,
    FunctionaryV31,
    FunctionaryV32,
    GptOss,
    JsonArray,
    KimiK2,
    Llama3,
    Mistral,
)
from .formats import THINK, ChatFormat, Glm45, Hermes, MiniMaxM2, Qwen3Coder

__all__ = ["RULES", "chat_format"]


def _has(*subs: str) -> Callable[[str], bool]:
    return lambda src: all(s in src for s in subs)


def _think(src: str) -> Optional[tuple[str, str]]:
    return THINK if "<think>" in src or "</think>" in src else None


#: (name, test on the template source, how to build the format from it), first match wins
RULES: list[tuple[str, Callable[[str], bool], Callable[[str], dict]]] = [
    ("gpt_oss", _has("<|channel|>"), lambda src: {"cls": GptOss}),
    ("functionary_v3_2", _has(">>>all"), lambda src: {"cls": FunctionaryV32}),
    ("kimi_k2", _has("<|tool_calls_section_begin|>"), lambda src: {"cls": KimiK2, "reasoning_tags": _think(src)}),
    ("deepseek", _has("<｜tool▁calls▁begin｜>"),
     lambda src: {"cls": DeepSeek, "reasoning_tags": _think(src), "fenced": "```json" in src}),
    ("command_r", _has("<|START_ACTION|>"),
     lambda src: {"cls": CommandR, "reasoning_tags": ("<|START_THINKING|>", "<|END_THINKING|>")
                  if "<|START_THINKING|>" in src else None}),
    ("mistral", _has("[TOOL_CALLS]"),
     lambda src: {"cls": Mistral, "reasoning_tags": ("[THINK]", "[/THINK]") if "[THINK]" in src else None,
                  "style": "call_id" if "[CALL_ID]" in src else "args" if "[ARGS]" in src else "json"}),
    # MiniMax M3's namespaced markup is not read yet: generic, rather than Hermes by its <tool_call>
    ("generic", _has("]<]minimax[>["), lambda src: {"cls": ChatFormat, "reasoning_tags": None}),
    ("json_array", _has("<tool_calls>["), lambda src: {"cls": JsonArray, "reasoning_tags": _think(src)}),
    ("json_array", _has("<TOOLCALL>["),
     lambda src: {"cls": JsonArray, "open_tag": "<TOOLCALL>", "close_tag": "</TOOLCALL>",
                  "reasoning_tags": _think(src)}),
    ("minimax_m2", _has("<minimax:tool_call>"), lambda src: {"cls": MiniMaxM2, "reasoning_tags": _think(src)}),
    ("seed_oss", _has("<seed:tool_call>"),
     lambda src: {"cls": Qwen3Coder, "open_tag": "<seed:tool_call>", "close_tag": "</seed:tool_call>",
                  "reasoning_tags": ("<seed:think>", "</seed:think>") if "<seed:think>" in src else None}),
    ("glm_4_5", _has("<tool_call>", "<arg_key>"), lambda src: {"cls": Glm45, "reasoning_tags": _think(src)}),
    ("qwen3_coder", _has("<tool_call>", "<function="), lambda src: {"cls": Qwen3Coder, "reasoning_tags": _think(src)}),
    ("hermes", _has("<tool_call>"), lambda src: {"cls": Hermes, "reasoning_tags": _think(src)}),
    ("functionary_v3_1", _has("<function=", "<|start_header_id|>"), lambda src: {"cls": FunctionaryV31}),
    ("llama3", lambda src: "<|start_header_id|>ipython<|end_header_id|>" in src
     or ("<|start_header_id|>" in src and '"parameters"' in src), lambda src: {"cls": Llama3}),
]


def chat_format(template_source: str, *, tools: Any = None, enable_thinking: bool = True,
                thinking_forced_open: Optional[bool] = None, **template_vars: Any) -> ChatFormat:
    """The reply format of the model whose chat template is ``template_source``.

    The family is recognised from the template's text (see :data:`RULES`); a template that
    matches no rule gets the generic :class:`ChatFormat` (content, and a leading
    ``<think>...</think>`` split off when the template uses think tags).

    Parameters
    ----------
    template_source : str
        The Jinja chat template (a GGUF's ``tokenizer.chat_template``).
    tools : list of dict, optional
        The request's tools (OpenAI shape): their schemas type XML-style parameters, and with
        tools the generic format reads llama.cpp's generic JSON calls.
    enable_thinking : bool
        Passed to the template when rendering the generation prompt (Qwen3 reads it).
    thinking_forced_open : bool, optional
        Whether the generation prompt opens the reasoning block. By default the template is
        rendered for a one-message conversation (with ``tools`` and ``template_vars``) and the
        prompt is checked for ending in the opening tag; a template that does not render counts
        as not opening it.
    **template_vars
        Other template variables for that render (``bos_token``, ...).

    Returns
    -------
    ChatFormat

    Raises
    ------
    GGMLTypeError
        ``template_source`` is not a str, or ``tools`` not a list of dicts.

    Examples
    --------
    >>> chat_format("{{ '[TOOL_CALLS]' }}").name
    'mistral'
    >>> chat_format("plain").parse("<think>x</think>y").reasoning is None
    True
    """
    if not isinstance(template_source, str):
        raise GGMLTypeError(f"chat_format: template_source must be a str, not {type(template_source).__name__}")
    kwargs: dict = {"cls": ChatFormat, "reasoning_tags": _think(template_source)}
    for _name, test, build in RULES:
        if test(template_source):
            kwargs = build(template_source)
            break
    cls = kwargs.pop("cls")
    tags = kwargs.get("reasoning_tags")
    if thinking_forced_open is None:
        thinking_forced_open = bool(tags) and _opens(template_source, tags[0], tools, enable_thinking, template_vars)
    return cls(tools=tools, thinking_forced_open=thinking_forced_open, **kwargs)


def _opens(src: str, open_tag: str, tools: Any, enable_thinking: bool, template_vars: dict) -> bool:
    """Whether the template's generation prompt ends inside an opened reasoning block."""
    from ggmlpy.tokenizer.chat_template import ChatTemplate

    try:
        t = ChatTemplate(src, **{k: template_vars.pop(k) for k in ("bos_token", "eos_token") if k in template_vars})
        prompt = t.render([{"role": "user", "content": "Hi"}], tools=tools or None, add_generation_prompt=True,
                          enable_thinking=enable_thinking, **template_vars)
    except (ValueError, TypeError):    # ChatTemplateError is a ValueError
        return False
    return prompt.rstrip().endswith(open_tag)
