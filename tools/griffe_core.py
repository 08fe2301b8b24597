"""Griffe extensions for the docs (mkdocs.yml): ``_core``'s docstrings, and Sphinx roles as code.

:class:`CoreDocstrings`: the API pages of ``ggmlpy._core`` get the compiled module's docstrings.

``_core`` is compiled; Griffe reads it from ``src/ggmlpy/_core.pyi``, whose signatures carry the types
but no docstrings (tools/gen_stubs.py writes signatures only, so the stub stays checkable against the
module). This extension imports the compiled module once and copies each object's ``__doc__`` onto the
stub's object of the same path, without the first line that ``embedsignature`` writes (the stub already
has the signature, with types). Docstrings of the stub's own objects are never replaced.

:class:`SphinxRoles`: the docstrings are numpydoc, whose cross-references are Sphinx roles
(``:class:`~.loop.RequestLoop```); mkdocstrings would print them as they are, so each becomes inline
code of the name as written, without the ``~`` and the leading dots (``RequestLoop``).
"""

from __future__ import annotations

import importlib
import inspect
import re

import griffe

MODULE = "ggmlpy._core"


_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const|ref|term):`(?P<target>[^`]+)`")


def _role_as_code(m: re.Match) -> str:
    target = m["target"]
    shown = re.match(r"(?P<text>.*?)\s*<(?P<ref>[^>]+)>$", target)        # :meth:`text <target>`
    if shown:
        return f"``{shown['text']}``"
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"``{target.lstrip('.')}``"


def _runtime_doc(obj, name: str) -> str | None:
    doc = getattr(obj, "__doc__", None)
    if not doc:
        return None
    lines = doc.splitlines()
    # embedsignature's first line: "name(args) -> ret"; the stub shows the signature with types
    if lines and re.match(rf"\s*{re.escape(name)}\(.*\)", lines[0]):
        lines = lines[1:]
    text = _ROLE.sub(_role_as_code, inspect.cleandoc("\n".join(lines)))
    return text or None


class CoreDocstrings(griffe.Extension):
    """Copy the compiled ``ggmlpy._core``'s docstrings onto the objects Griffe read from its stub."""

    def on_module(self, *, mod: griffe.Module, loader: griffe.GriffeLoader | None = None, **kwargs) -> None:
        if mod.path == MODULE:
            # parsed as every other docstring is (mkdocs.yml: numpy style)
            self._parser = loader.docstring_parser if loader is not None else None
            self._options = loader.docstring_options if loader is not None else {}
            self._fill(mod, importlib.import_module(MODULE))

    def _fill(self, node: griffe.Object, runtime: object) -> None:
        for name, member in list(node.members.items()):
            if member.is_alias:
                continue
            value = runtime.__dict__.get(name) if isinstance(runtime, type) else getattr(runtime, name, None)
            if value is None and isinstance(runtime, type):
                value = getattr(runtime, name, None)          # found in a private base class
            if value is None:
                continue
            if name == "__init__" and isinstance(runtime, type):
                continue                                      # the class docstring documents the parameters
            if member.docstring is None:
                doc = _runtime_doc(value, name)
                if doc:
                    member.docstring = griffe.Docstring(doc, parent=member, parser=self._parser,
                                                        parser_options=self._options)
            if member.is_class:
                self._fill(member, value)


class SphinxRoles(griffe.Extension):
    """Sphinx roles (``:class:`x```) in docstrings become inline code (``x``)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(_role_as_code, obj.docstring.value)
