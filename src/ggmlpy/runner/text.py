"""Text for the runner: prompts from text and chat messages, and the generated tokens back as text.

Three small pieces, each usable (and tested) without a model:

* :class:`StopMatcher` cuts a stream of text before the first stop string, whatever the chunks the text
  arrives in, holding back only what could still be the start of a stop string;
* :class:`TextStream` is one request's token-to-text path: the tokenizer's streaming detokenizer (a
  character split across byte tokens is held back until whole), then the stop strings;
* :func:`encode_prompt` and :func:`chat_prompt` turn text and chat messages into prompt ids with the
  rules for BOS that llama.cpp's completion endpoint and transformers' chat templates need.

The tokenizer is anything with :class:`ggmlpy.tokenizer.Tokenizer`'s ``encode``, ``detokenizer``,
``apply_chat_template``, ``bos`` and ``add_bos``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

from ggmlpy._core import GGMLTypeError, GGMLValueError

__all__ = ["StopMatcher", "TextStream", "chat_prompt", "chat_text", "encode_chat", "encode_prompt", "split_stops"]


class StopMatcher:
    """Cut a stream of text before the first stop string, across chunk boundaries.

    :meth:`push` takes the next chunk and returns the text that can be shown now: everything except a
    tail that could still grow into a stop string (held back until the next chunk decides). Once a stop
    string is complete the stream is over: the text before it is returned with ``stopped=True``, and
    the stop string and anything after it are never returned. :meth:`flush` gives back what is held at
    the end of the stream (a tail that never became a stop string).

    Which stop ends the text: the first one to be completed, reading character by character; of
    several completed by the same character, the longest (the one starting earliest). So the result
    depends only on the concatenated text, never on how it was cut into chunks.

    Parameters
    ----------
    stops : iterable of str
        The stop strings (duplicates are ignored); none means the text passes through unchanged.

    Raises
    ------
    GGMLValueError
        An empty stop string (it would end every text before its first character).
    GGMLTypeError
        A stop that is not a str.

    Examples
    --------
    >>> m = StopMatcher(["</s>"])
    >>> m.push("Hello</"), m.push("s> ignored")
    (('Hello', False), ('', True))
    >>> m = StopMatcher(["###"])
    >>> m.push("a #"), m.push("# b"), m.flush()
    (('a ', False), ('## b', False), '')
    """

    __slots__ = ("stops", "stopped", "matched", "_held")

    def __init__(self, stops: Iterable[str] = ()) -> None:
        out = []
        for s in stops:
            if not isinstance(s, str):
                raise GGMLTypeError(f"stop strings: expected str, got {type(s).__name__} ({s!r})")
            if not s:
                raise GGMLValueError("stop strings: an empty stop string would end every text at once")
            if s not in out:
                out.append(s)
        self.stops: tuple[str, ...] = tuple(out)
        self.stopped = False
        #: the stop string that ended the text, once one did
        self.matched: Optional[str] = None
        self._held = ""

    @property
    def held(self) -> str:
        """Text held back: a tail that could still become a stop string."""
        return self._held

    def push(self, text: str) -> tuple[str, bool]:
        """Take the next chunk; return ``(text to show now, whether a stop string ended the stream)``."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        if not text:
            return "", False
        buf = self._held + text
        # The held part holds no complete stop string (it would have ended the stream), so every
        # occurrence found now ends in the new text. The first to complete is the one ending first.
        end = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (end < 0 or i + len(s) < end):
                end = i + len(s)
        if end >= 0:
            cut, matched = end, None
            for s in self.stops:                       # the longest ending there starts earliest
                if buf.endswith(s, 0, end) and end - len(s) < cut:
                    cut, matched = end - len(s), s
            self.stopped, self.matched, self._held = True, matched, ""
            return buf[:cut], True
        k = self._partial(buf)
        self._held = buf[len(buf) - k:] if k else ""
        return buf[:len(buf) - k], False

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string (0 if none).

        Every later occurrence starts inside that tail: any position where one could start has the
        rest of ``buf`` as a prefix of it, and the longest such tail reaches back to the first.
        """
        best = 0
        n = len(buf)
        for s in self.stops:
            for k in range(min(len(s) - 1, n), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """The held tail, at the end of the stream (``""`` once a stop string ended it)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


class TextStream:
    """One request's generated tokens as text: the streaming detokenizer, then the stop strings.

    Parameters
    ----------
    detokenizer
        A :class:`ggmlpy.tokenizer.Detokenizer` (``feed(id) -> str``, ``flush() -> str``).
    stops : iterable of str
        Stop strings (see :class:`StopMatcher`).
    """

    __slots__ = ("_detok", "matcher", "_done")

    def __init__(self, detokenizer: Any, stops: Iterable[str] = ()) -> None:
        self._detok = detokenizer
        self.matcher = StopMatcher(stops)
        self._done = False

    def feed(self, token: int) -> tuple[str, bool]:
        """The text ``token`` completes, and whether a stop string ended the text with it."""
        if self._done or self.matcher.stopped:
            return "", self.matcher.stopped
        return self.matcher.push(self._detok.feed(token))

    def finish(self) -> str:
        """What was held back, at the end of the generation (an unfinished character as U+FFFD, a tail
        that did not become a stop string); ``""`` after a stop string or a previous finish."""
        if self._done:
            return ""
        self._done = True
        if self.matcher.stopped:
            return ""
        emit, stopped = self.matcher.push(self._detok.flush())
        return emit if stopped else emit + self.matcher.flush()

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the text."""
        return self.matcher.stopped


def split_stops(stop: Any, what: str = "submit") -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Split a ``stop`` argument into stop token ids and stop strings (a lone str is one stop string).

    Raises
    ------
    GGMLTypeError
        An element that is neither an int nor a str.
    GGMLValueError
        An empty stop string.
    """
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        stop = (stop,)
    ids, texts = [], []
    try:
        items = list(stop)
    except TypeError:
        raise GGMLTypeError(f"{what}: stop must be a sequence of token ids and strings "
                            f"(got {type(stop).__name__})") from None
    for s in items:
        if isinstance(s, str):
            if not s:
                raise GGMLValueError(f"{what}: an empty stop string would end every text at once")
            texts.append(s)
        elif isinstance(s, bool) or not hasattr(s, "__index__"):
            raise GGMLTypeError(f"{what}: a stop must be a token id (int) or a stop string (str), "
                                f"got {type(s).__name__} ({s!r})")
        else:
            ids.append(int(s))
    return tuple(ids), tuple(texts)


def encode_prompt(tokenizer: Any, text: str, parse_special: bool = True) -> list[int]:
    """A text prompt's ids, as llama.cpp's completion endpoint makes them.

    ``tokenizer.encode(text, add_special=True, parse_special=parse_special)``: BOS (and EOS, for
    vocabularies that add it) as the file says, and special tokens written in the text (``<|im_start|>``)
    parsed as those tokens, as llama.cpp's server and ``llama-cli`` do. One difference: a text that
    itself starts with the BOS token's text gets one BOS, not two (llama.cpp keeps both and warns).

    Parameters
    ----------
    parse_special : bool
        False reads special tokens' texts as plain text: use it for text from users who must not be
        able to write control tokens.
    """
    if not isinstance(text, str):
        raise GGMLTypeError(f"encode_prompt: expected str, got {type(text).__name__}")
    ids = list(tokenizer.encode(text, add_special=True, parse_special=parse_special))
    bos = getattr(tokenizer, "bos", None)
    if getattr(tokenizer, "add_bos", False) and bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    return ids


def chat_prompt(tokenizer: Any, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                tools: Optional[Sequence[dict]] = None, template: Optional[str] = None,
                template_kwargs: Optional[dict] = None) -> list[int]:
    """The prompt ids of a chat: the rendered chat template, tokenized.

    The template (the GGUF's ``tokenizer.chat_template``, or ``template``) is rendered by
    ``tokenizer.apply_chat_template`` and encoded with special tokens parsed and nothing added
    (``add_special=False``), as llama.cpp's server does; then BOS is put first when the tokenizer adds
    BOS and the text did not start with it. Templates written for transformers put ``bos_token`` in the
    text themselves, others (ChatML) do not: either way the prompt has exactly one BOS.

    Raises
    ------
    TokenizerError
        No chat template in the file and none given.
    ChatTemplateError
        The template failed (its own ``raise_exception``, a loop or output over the limits).
    """
    return encode_chat(tokenizer, chat_text(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                            tools=tools, template=template, template_kwargs=template_kwargs))


def chat_text(tokenizer: Any, messages: Sequence[dict], *, add_generation_prompt: bool = True,
              tools: Optional[Sequence[dict]] = None, template: Optional[str] = None,
              template_kwargs: Optional[dict] = None) -> str:
    """The rendered chat template of :func:`chat_prompt` (the text before it is tokenized)."""
    kw = dict(template_kwargs or {})
    if template is not None:
        kw["template"] = template
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                                         **kw)


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    """A rendered chat's ids (:func:`chat_prompt`): special tokens parsed, nothing added but one BOS."""
    ids = list(tokenizer.encode(text, add_special=False, parse_special=True))
    bos = getattr(tokenizer, "bos", None)
    if getattr(tokenizer, "add_bos", False) and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def chat_constraint(params, fmt, tools, tool_choice, response_format):
    """A chat's SamplingParams with the constraint its ``tool_choice`` or ``response_format`` asks for:
    ``"required"`` or a named function forces one tool call in the template's format (the format's
    Lark grammar, :meth:`ggmlpy.chat.ChatFormat.tool_grammar`), a ``response_format`` its JSON; at most
    one constraint per request (one given in ``params`` too is an error)."""
    import dataclasses

    from ggmlpy.sampling.grammar import Grammar

    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise GGMLValueError(f"submit_chat: tool_choice must be 'auto', 'none', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {type(tool_choice).__name__}")
    grammar, why = None, None
    if tool_choice not in (None, "auto", "none"):
        if fmt is None:
            raise GGMLValueError(f"submit_chat: tool_choice={tool_choice!r} needs a chat template")
        lark = fmt.tool_grammar(list(tools or ()), tool_choice)
        if lark is not None:
            grammar, why = Grammar.lark(lark), f"tool_choice={tool_choice!r}"
    if response_format is not None:
        rf = Grammar.from_response_format(response_format)
        if rf is not None:
            if grammar is not None:
                raise GGMLValueError(f"submit_chat: response_format and {why} given together: one constraint "
                                     f"per request")
            grammar, why = rf, "response_format"
    if grammar is None:
        return params
    if params.constraint is not None:
        raise GGMLValueError(f"submit_chat: {why} and a grammar or json_schema given together: one constraint "
                             f"per request")
    return dataclasses.replace(params, grammar=grammar)
