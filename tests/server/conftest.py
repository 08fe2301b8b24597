"""tests/server: a converted chat model (tests/text_helpers.py) shared by the modules."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")


@pytest.fixture(scope="session")
def chat_gguf(tmp_path_factory):
    from text_helpers import llama_chat_gguf

    return llama_chat_gguf(tmp_path_factory)


@pytest.fixture(scope="session")
def reference(chat_gguf):
    """The same file in this process, as a Runner (the answers the server must give)."""
    from ggmlpy import load_model
    from ggmlpy.runner import Runner

    # reuse_graphs=False: no graph outlives its batch, so the per-test count of live handles holds
    with load_model(str(chat_gguf), devices="cpu") as model, Runner(model, n_ctx=512, reuse_graphs=False) as rt:
        rt.generate("warm up", max_tokens=2, temperature=0)
        rt.embed("warm up")
        yield rt
