"""tool_grammar: each format's grammar compiles with llguidance, accepts the format's call (which parses
back to it) and rejects a wrong name or a missing required argument."""

from __future__ import annotations

import pytest
from chat_refs import TOOLS, sources

from ggmlpy._core import GGMLValueError
from ggmlpy.chat import chat_format

llguidance = pytest.importorskip("llguidance")


class _Bytes:
    """A tokenizer of 256 byte tokens and an EOS."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s):
        return list(s if isinstance(s, bytes) else s.encode())


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
A = '{"city": "Paris", "days": 3}'
#: template -> a call to get_weather(city="Paris", days=3) as the grammar writes it
CALLS = {
    "Qwen-Qwen2.5-7B-Instruct": '<tool_call>\n{"name": "get_weather", "arguments": ' + A + '}\n</tool_call>',
    "Qwen-Qwen3-0.6B": '<think>hmm</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' + A +
                       '}\n</tool_call>',
    "Qwen3.5-4B": 'hmm </think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                  '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>',
    "GLM-4.6": "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
               "<arg_value>3</arg_value></tool_call>",
    "MiniMax-M2": 'x</think>\n<minimax:tool_call>\n<invoke name="get_weather"><parameter name="city">Paris</parameter>'
                  '<parameter name="days">3</parameter></invoke>\n</minimax:tool_call>',
    "meta-llama-Llama-3.1-8B-Instruct": '{"name": "get_weather", "parameters": ' + A + "}",
    "meetkai-functionary-medium-v3.1": "<function=get_weather>" + A + "</function>",
    "meetkai-functionary-medium-v3.2": "get_weather\n" + A,
    "mistralai-Mistral-Nemo-Instruct-2407": '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + A +
                                            ', "id": "aB3dE6gH9"}]',
    "Mistral-Small-3.2-24B-Instruct-2506": "[TOOL_CALLS]get_weather[CALL_ID]aB3dE6gH9[ARGS]" + A,
    "unsloth-mistral-Devstral-Small-2507": "[TOOL_CALLS]get_weather[ARGS]" + A,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "ok</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                                                "function<｜tool▁sep｜>get_weather\n```json\n" + A +
                                                "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek-ai-DeepSeek-V3.1": "x</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + A +
                                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "moonshotai-Kimi-K2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                          "<|tool_call_argument_begin|>" + A + "<|tool_call_end|><|tool_calls_section_end|>",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use":
        '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": ' + A +
        "}\n]<|END_ACTION|>",
    "openai-gpt-oss-120b": "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary "
                           "to=functions.get_weather <|constrain|>json<|message|>" + A + "<|call|>",
    "unsloth-Apriel-1.5": '<tool_calls>[{"name": "get_weather", "arguments": ' + A + "}]</tool_calls>",
    "llama-cpp-rwkv-world": 'x</think>{"tool_call": {"name": "get_weather", "arguments": ' + A + "}}",
}


def _accepts(grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(TOKENIZER, grammar)
    tokens = list(text.encode())
    return m.validate_tokens(tokens) == len(tokens) and m.consume_tokens(tokens) and m.is_accepting()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_grammar_forces_the_call(name):
    fmt = chat_format(sources()[name], tools=TOOLS)
    text = CALLS[name]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        lark = fmt.tool_grammar(TOOLS, choice)
        grammar = llguidance.grammar_from("lark", lark)
        assert llguidance.LLMatcher.validate_grammar(grammar, TOKENIZER) == "", lark
        assert _accepts(grammar, text), (lark, text)
        assert not _accepts(grammar, text.replace("get_weather", "get_wether")), "a tool that does not exist"
        assert not _accepts(grammar, text.replace("Paris", "Paris", 1).replace("city", "town")), "no city"
    got = fmt.parse(text)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", {"city": "Paris", "days": 3})]


def test_grammar_is_none_unless_forced_and_checks_its_arguments():
    fmt = chat_format(sources()["Qwen-Qwen2.5-7B-Instruct"])
    assert fmt.tool_grammar(TOOLS, "auto") is None and fmt.tool_grammar(TOOLS, "none") is None
    with pytest.raises(GGMLValueError, match="not among"):
        fmt.tool_grammar(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(GGMLValueError, match="needs tools"):
        fmt.tool_grammar([], "required")
    with pytest.raises(GGMLValueError, match="tool_choice"):
        fmt.tool_grammar(TOOLS, "sometimes")
