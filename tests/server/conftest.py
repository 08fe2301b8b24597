"""tests/server: a converted chat model (tests/text_helpers.py), the server process the Ollama and extras tests
share, and the in-process runner every module compares against; each made once per test session.

The shared server and the reference runner have the same settings (:data:`server_helpers.N_CTX` tokens a slot,
:data:`server_helpers.N_PARALLEL` slots, the CPU, ggml's kernels), so a greedy reply of one is the other's.
Modules that need other flags (an API key, a template, a small queue) start their own
:class:`server_helpers.ServerProcess`.
"""

from __future__ import annotations

import pytest
from server_helpers import N_CTX, N_PARALLEL, ServerProcess

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")


@pytest.fixture(scope="session")
def chat_gguf(tmp_path_factory):
    from text_helpers import llama_chat_gguf

    return llama_chat_gguf(tmp_path_factory)


@pytest.fixture(scope="session")
def reference(chat_gguf):
    """The same file in this process, as a Runner (the answers the servers must give)."""
    from ggmlpy import load_model
    from ggmlpy.runner import Runner

    # reuse_graphs=False: no graph outlives its batch, so the suite's per-test count of live handles holds
    # for a runner shared by every test
    with load_model(str(chat_gguf), devices="cpu") as model, \
            Runner(model, n_ctx=N_CTX, n_seq_max=N_PARALLEL, kernels="ggml", reuse_graphs=False) as rt:
        rt.generate("warm up", max_tokens=2, temperature=0)
        rt.embed("warm up")
        yield rt


@pytest.fixture(scope="session")
def shared(chat_gguf, tmp_path_factory):
    """``ggmlpy serve -np 2 --slot-save-path DIR --alias tiny`` on the chat model; ``.slots`` is DIR."""
    slots = tmp_path_factory.mktemp("slots") / "saved"
    slots.mkdir()
    srv = ServerProcess(chat_gguf, "-c", N_CTX, "-np", N_PARALLEL, "-dev", "cpu", "--slot-save-path", slots,
                        "--alias", "tiny")
    srv.slots = slots
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="session")
def http(shared):
    """An httpx client of the shared server."""
    import httpx

    with httpx.Client(base_url=shared.url, timeout=120) as c:
        yield c
