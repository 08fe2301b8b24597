"""llama.cpp's GBNF as llguidance Lark with GBNF's meaning: every rule a parser rule, every lexeme one
character.

llguidance's own converter (``llguidance.gbnf_to_lark``) turns rules made only of characters into
lexemes and splits literals into whole-string lexemes, and llguidance's lexer is greedy: a lexeme that
can go on, goes on. llama.cpp's grammar engine has no lexer (it steps a pushdown automaton one code
point at a time), so with that converter grammars llama.cpp accepts text for are refused:
arithmetic.gbnf's ``num ::= [0-9]+ ws`` with ``ws ::= [ \\t\\n]*`` swallows the ``"\\n"`` that ends
the line ("x=1\\n" never completes), ``[a-z]+ "ing"`` refuses "singing", ``("a" | "ab") "bc"``
refuses "abc". Here the text is parsed by that converter's parser (its error messages, its escapes),
then every rule is kept a parser rule and every literal becomes a sequence of one-character
literals, so each lexeme is a single character and the Earley parser decides every ambiguity as
llama.cpp's automaton does. GBNF's ``.`` is any character, the newline too (llama.cpp's
``CHAR_ANY``). The cost is a slower mask on grammars with long character runs (measured in
docs/generation.md); a Lark grammar (:meth:`ggmlpy.sampling.grammar.Grammar.lark`) keeps
llguidance's lexemes for who wants them.
"""

from __future__ import annotations

__all__ = ["gbnf_to_lark"]


def gbnf_to_lark(text: str) -> str:
    """``text`` (GBNF) as llguidance Lark with GBNF's meaning (see the module's docstring).

    Raises what ``llguidance.gbnf_to_lark`` raises for text that does not parse (its
    ``GbnfToLarkError`` with the line, or ``Exception`` for a missing rule or ``root``)."""
    from llguidance import gbnf_to_lark as conv

    rules = _Parser(conv).parse(text)
    conv.resolve(rules)
    for node in _nodes(rules.values()):
        if isinstance(node, conv.RegexNode) and node.rx == ".":
            node.rx = "(?s:.)"
    for r in list(rules.values()):
        if r.rule_is_terminal:   # made a lexeme by the converter: a parser rule again, under a free name
            r.rule_is_terminal = False
            name, n = r.name.lower(), 0
            while name in rules:
                n += 1
                name = f"{r.name.lower()}_{n}"
            del rules[r.name]
            r.name = name
            rules[name] = r
    out = ["%llguidance {}", ""]
    out += [str(r) for r in sorted(rules.values(), key=lambda r: r.order)]
    return "\n".join(out) + "\n"


def _Parser(conv):   # noqa: N802 - a class made over the converter module, imported lazily
    class Parser(conv.GrammarParser):
        def _parse_char(self, pos):
            c, pos = super()._parse_char(pos)
            if c[:2] in ("\\u", "\\U"):
                # the converter strips the leading zeros, which llguidance then refuses ("\\ue9");
                # written as llguidance's strings and Rust's regexes both read it
                cp = int(c[2:] or "0", 16)
                if cp > 0x10FFFF:
                    raise conv.GbnfToLarkError(pos, f"{c} is past the last code point (U+10FFFF)")
                c = f"\\u{cp:04x}" if cp < 0x10000 else chr(cp)
            return c, pos

        def _parse_literal(self, pos):
            if pos.current() != '"':
                raise conv.GbnfToLarkError(pos, "Expected '\"'")
            pos, units = pos.advance(), []
            while True:
                c, pos = self._parse_char(pos)
                if c == '"':
                    break
                units.append(conv.LiteralNode(c))
            if len(units) == 1:
                return units[0], pos
            return conv.SequenceNode(units), pos    # "" stays the empty sequence

    return Parser()


def _nodes(rules) -> list:
    out, todo = [], [r.alternatives for r in rules]
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(node.children())
    return out
