"""runner.py: generation against transformers' greedy decoding, pipelined == sequential, batching across
sequences, context shift and prefix reuse against from-scratch runs, logprobs, threads and cancellation,
bad input and recovery."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hf_helpers import VOCAB, export_gguf, hf_logits, hf_model

from ggmlpy import GGMLValueError
from ggmlpy.models import load_model
from ggmlpy.runner import DoneReason, InputTooLong, Runner, RunnerError
from ggmlpy.sampling import SamplingParams

pytestmark = pytest.mark.hf

PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11, 200]


@pytest.fixture(scope="module")
def hf_and_path(tmp_path_factory):
    hf = hf_model("llama", seed=11)
    return hf, export_gguf(hf, tmp_path_factory.mktemp("rn") / "m.gguf", "llama")


@pytest.fixture(scope="module")
def model(hf_and_path):
    m = load_model(hf_and_path[1], devices="cpu")
    yield m
    m.close()


def hf_greedy(hf, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(hf_logits(hf, toks)[-1].argmax()))
    return toks[len(prompt):]


def test_greedy_generation_matches_transformers(hf_and_path, model):
    hf, _ = hf_and_path
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        r = rt.generate(PROMPT, max_tokens=12, temperature=0)
    assert r.tokens == hf_greedy(hf, PROMPT, 12)
    assert r.done_reason == DoneReason.LENGTH and r.eval_count == 12 and r.prompt_eval_count == len(PROMPT)
    assert r.ttft > 0 and r.eval_duration > 0


@pytest.mark.parametrize("n_seq", [1, 3])
def test_pipelined_equals_sequential(model, n_seq):
    prompts = [PROMPT, PROMPT[2:9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]][:n_seq]
    outs = {}
    for pipeline in (False, True):
        with Runner(model, n_ctx=64, n_seq_max=n_seq, n_batch=8, pipeline=pipeline) as rt:
            hs = [rt.submit(p, max_tokens=20, temperature=0) for p in prompts]
            outs[pipeline] = [h.result().tokens for h in hs]
            if pipeline:
                assert rt.n_batches > 20
            assert rt.reallocations == 0           # the start-up reservation covered every batch
    assert outs[True] == outs[False]


@pytest.mark.parametrize("pipeline", [False, True])
def test_concurrent_requests_equal_each_alone(model, pipeline):
    prompts = [PROMPT, PROMPT[:5], [7, 7, 7, 1], PROMPT[3:], [300, 200, 100]]
    with Runner(model, n_ctx=48, type_k="f32", type_v="f32") as rt:
        alone = [rt.generate(p, max_tokens=10, temperature=0).tokens for p in prompts]
    with Runner(model, n_ctx=48, n_seq_max=3, n_batch=16, type_k="f32", type_v="f32", pipeline=pipeline) as rt:
        results = [None] * len(prompts)

        def worker(i):
            results[i] = rt.generate(prompts[i], max_tokens=10, temperature=0).tokens

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == alone


def test_stream_stop_token_and_logprobs(hf_and_path, model):
    hf, _ = hf_and_path
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        first = rt.generate(PROMPT, max_tokens=6, temperature=0).tokens
        stop = first[3]
        h = rt.submit(PROMPT, max_tokens=20, stop=[stop],
                      sampling=SamplingParams(temperature=0, logprobs=True, top_logprobs=5))
        events = list(h)
        r = h.result()
    assert [e.token for e in events] == r.tokens == first[:first.index(stop) + 1]
    assert r.done_reason == DoneReason.STOP
    ref = hf_logits(hf, PROMPT + r.tokens[:-1])[len(PROMPT) - 1:]
    for lp, row in zip(r.logprobs, ref):
        ls = row.astype(np.float64) - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert abs(lp.logprob - ls[lp.token]) < 1e-3
        assert [t.token for t in lp.top] == list(np.argsort(-ls, kind="stable")[:5])


def test_sampling_is_seeded(model):
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=123)
    with Runner(model, n_ctx=64) as rt:
        a = rt.generate(PROMPT, max_tokens=15, sampling=sp).tokens
        b = rt.generate(PROMPT, max_tokens=15, sampling=sp).tokens
        c = rt.generate(PROMPT, max_tokens=15,
                        sampling=SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=7)).tokens
    assert a == b and a != c


def test_context_shift_keeps_generating(hf_and_path, model):
    """n_ctx 16: generation continues past the context by shifting; the logits after the shift equal a
    from-scratch run over the kept tokens (checked through greedy tokens with an F32 cache)."""
    with Runner(model, n_ctx=16, type_k="f32", type_v="f32") as rt:
        r = rt.generate(PROMPT[:6], max_tokens=30, n_keep=2, temperature=0)
        assert r.n_shifts >= 1 and len(r.tokens) == 30 and r.done_reason == DoneReason.LENGTH
    with Runner(model, n_ctx=16, type_k="f32", type_v="f32") as rt:
        r2 = rt.generate(PROMPT[:6], max_tokens=30, n_keep=2, shift=False, temperature=0)
        # the last token is sampled from position 15 but never fed: 16 - 6 + 1 tokens
        assert r2.done_reason == DoneReason.LENGTH and len(r2.tokens) == 16 - 6 + 1
        assert r2.tokens == r.tokens[:len(r2.tokens)]


def test_shift_result_equals_from_scratch(tmp_path):
    """The token sampled right after a shift equals the one a fresh run over the kept tokens gives
    (one layer, where a shift is exact: see test_models_llama)."""
    from ggmlpy.sequences import shift_discard

    model = load_model(export_gguf(hf_model("llama", layers=1, seed=12), tmp_path / "m.gguf", "llama"), devices="cpu")
    prompt = PROMPT[:6]
    n_ctx, keep = 16, 2
    with model, Runner(model, n_ctx=n_ctx, type_k="f32", type_v="f32", pipeline=False) as rt:
        r = rt.generate(prompt, max_tokens=n_ctx - len(prompt) + 2, n_keep=keep, temperature=0)
        assert r.n_shifts == 1
        history = prompt + r.tokens[:-1]
        full = history[:n_ctx]                           # the context when it filled
        d = shift_discard(len(full), keep, n_ctx)
        kept = full[:keep] + full[keep + d:] + history[n_ctx:]
        rt.clear()
        logits = rt.decode(kept)
    assert int(logits[0].argmax()) == r.tokens[-1]


def test_prefix_reuse(model):
    with Runner(model, n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as rt:
        a = rt.generate(PROMPT, max_tokens=5, temperature=0)
        assert a.n_cached == 0
        b = rt.generate(PROMPT + a.tokens[:2] + [9], max_tokens=5, temperature=0)  # shares the whole history
        assert b.n_cached == len(PROMPT) + 2
        c = rt.generate(PROMPT, max_tokens=5, temperature=0)            # fully cached: last token re-evaluated
        assert c.n_cached == len(PROMPT) - 1
        assert c.tokens == a.tokens
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        fresh = rt.generate(PROMPT + a.tokens[:2] + [9], max_tokens=5, temperature=0)
    assert b.tokens == fresh.tokens


def test_prefix_fork_from_a_busy_slot(model):
    with Runner(model, n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32", n_batch=4) as rt:
        long = rt.submit(PROMPT, max_tokens=40, temperature=0)
        next(iter(long))                                                 # slot 0 is busy now
        b = rt.submit(PROMPT[:8] + [1, 2], max_tokens=5, temperature=0).result()
        long.result()
        assert b.n_cached == 8
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        fresh = rt.generate(PROMPT[:8] + [1, 2], max_tokens=5, temperature=0)
    assert b.tokens == fresh.tokens


def test_bad_input_then_serves_correctly(model):
    with Runner(model, n_ctx=16, n_seq_max=2) as rt:
        good = rt.generate(PROMPT[:4], max_tokens=3, temperature=0).tokens
        with pytest.raises(ValueError, match="outside the vocabulary"):
            rt.submit([1, VOCAB, 2])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            rt.decode([-1])
        with pytest.raises(ValueError, match="outside the context"):
            rt.decode([1, 2], positions=[15, 16])
        with pytest.raises(ValueError, match="n_seq_max=2"):
            rt.decode([1], seq=2)
        with pytest.raises(InputTooLong, match="exceeds the context length"):
            rt.submit(list(range(1, 20)))
        t = rt.generate(list(range(1, 20)), max_tokens=2, truncate=True, n_keep=2, temperature=0)
        assert t.prompt_eval_count == 16 and len(t.tokens) == 2      # 3 tokens after n_keep dropped
        rt.clear()
        assert rt.generate(PROMPT[:4], max_tokens=3, temperature=0).tokens == good


@pytest.mark.parametrize("pipeline", [False, True])
def test_thousands_of_cancelled_requests_leak_nothing(model, pipeline):
    """2,000 requests cancelled from another thread while they wait, prefill or stream."""
    import time

    with Runner(model, n_ctx=32, n_seq_max=4, n_batch=8, pipeline=pipeline) as rt:
        handles = [rt.submit(PROMPT[:3 + i % 5], max_tokens=50, temperature=0) for i in range(2000)]

        def canceller():
            for i, h in enumerate(handles):
                if i % 200 == 0:
                    time.sleep(0.02)          # let some requests start generating first
                h.cancel()

        t = threading.Thread(target=canceller)
        t.start()
        results = [h.result(timeout=120) for h in handles]
        t.join()
        reasons = {r.done_reason for r in results}
        assert reasons <= {DoneReason.CANCEL, DoneReason.LENGTH}
        assert any(r.done_reason == DoneReason.CANCEL and r.tokens for r in results)   # cut mid-stream
        assert rt.wait_idle(timeout=10)       # the loop's last pipelined batch may still be computing
        assert not rt._active and not rt._waiting and rt._inflight == 0
        assert all(not s.in_use for s in rt.slots.slots)
        assert rt.generate(PROMPT, max_tokens=3, temperature=0).done_reason == DoneReason.LENGTH


def test_error_in_one_request_fails_only_that_request(model, monkeypatch):
    import ggmlpy.runner.loop as runner_mod  # where a request makes its sampler

    class Failing(runner_mod.Sampler):
        def sample(self, logits):
            raise ValueError("boom")

    with Runner(model, n_ctx=16) as rt:
        monkeypatch.setattr(runner_mod, "Sampler", Failing)      # the request's sampler fails, always
        h = rt.submit(PROMPT[:3], max_tokens=3, sampling=SamplingParams(temperature=1.0, seed=1))
        monkeypatch.undo()
        with pytest.raises(RunnerError, match="boom"):
            h.result()
        assert rt.generate(PROMPT[:3], max_tokens=2, temperature=0).done_reason == DoneReason.LENGTH


def test_same_batch_groups_are_never_split(model):
    prompt = PROMPT[:10]
    sb = [0] * 10
    sb[2] = 3                                         # inputs 2..5 go in one batch
    with Runner(model, n_ctx=32, n_batch=4, n_ubatch=4, pipeline=False) as rt:
        r = rt.generate(prompt, max_tokens=3, same_batch=sb, temperature=0)
        assert list(rt.batch_sizes)[:3] == [[2], [4], [4]]
        plain = rt.generate(PROMPT[:9] + [1], max_tokens=3, temperature=0)
        assert plain.n_cached == 9                    # the shared prefix 0..8 was reused
    with Runner(model, n_ctx=32, n_batch=4, n_ubatch=4) as rt:
        assert rt.generate(prompt, max_tokens=3, temperature=0).tokens == r.tokens
        with pytest.raises(ValueError, match="same_batch"):
            rt.submit(prompt, same_batch=[0] * 9 + [2])      # runs past the prompt
    with Runner(model, n_ctx=32, n_batch=8, n_ubatch=3, pipeline=False) as rt:
        sb = [0] * 10
        sb[1] = 2                                     # 1..3 in one micro-batch: the cut moves back
        rt.generate(prompt, max_tokens=1, same_batch=sb, temperature=0)
        assert list(rt.batch_sizes)[0] == [1, 3, 3, 1]


def test_reused_prefix_ends_before_a_group(model):
    """A cached prefix that would end inside the new prompt's same-batch group is reused up to the group."""
    prompt = PROMPT[:10]
    with Runner(model, n_ctx=32, n_batch=4, n_ubatch=4, pipeline=False) as rt:
        rt.generate(prompt, max_tokens=1, temperature=0)
        sb = [0] * 12
        sb[8] = 3                                      # inputs 8..11 in one batch: the cache holds 0..9
        r = rt.generate(prompt + [5, 6], max_tokens=3, same_batch=sb, temperature=0)
        assert r.n_cached == 8
    with Runner(model, n_ctx=32, n_batch=4, n_ubatch=4, pipeline=False) as rt:
        assert rt.generate(prompt + [5, 6], max_tokens=3, same_batch=sb, temperature=0).tokens == r.tokens


@pytest.mark.parametrize("pipeline", [False, True])
def test_slot_record_is_what_the_cache_holds(model, pipeline):
    """The slot table's record (the runner keeps no copy) after streaming, pipelined placeholders and a
    context shift: one token per cached position, none unknown, and a prompt extending it reuses all of it
    and gives what a fresh runner gives."""
    with Runner(model, n_ctx=32, n_seq_max=2, n_batch=8, pipeline=pipeline) as rt:
        hs = [rt.submit(PROMPT, max_tokens=12, temperature=0),
              rt.submit(PROMPT[:5], max_tokens=40, n_keep=2, temperature=0)]
        rs = [h.result() for h in hs]
        assert rs[1].n_shifts >= 1
        for slot in range(2):
            rec = rt.slots[slot].tokens
            assert len(rec) == rt.seq_len(slot) and -1 not in rec
        full = PROMPT + rs[0].tokens
        rec = rt.slots[0].tokens if rt.slots[0].tokens[:len(PROMPT)] == PROMPT else rt.slots[1].tokens
        assert rec == full[:len(rec)] and len(rec) >= len(full) - 1
        again = rt.generate(rec + [7], max_tokens=4, temperature=0)
        assert again.n_cached == len(rec)
    with Runner(model, n_ctx=32) as fresh:
        assert fresh.generate(rec + [7], max_tokens=4, temperature=0).tokens == again.tokens


def test_prefix_reuse_with_a_sliding_window(tmp_path):
    """mistral with a window of 6: the cache keeps only the last positions, so a prompt may resume
    where the window's history is still stored, and is re-processed fully where it was evicted;
    both give what a fresh run (and transformers) give."""
    hf = hf_model("mistral", seed=13)
    with load_model(export_gguf(hf, tmp_path / "m.gguf", "mistral"), devices="cpu") as m:
        with Runner(m, n_ctx=32, n_seq_max=2, type_k="f32", type_v="f32") as rt:
            rt.generate(PROMPT, max_tokens=1, temperature=0)        # stores positions 6..12
            tail = rt.generate(PROMPT + [9], max_tokens=6, temperature=0)  # needs 7..11: forked, resumed at 12
            assert tail.n_cached == len(PROMPT)
            head = rt.generate(PROMPT[:4] + [8], max_tokens=6, temperature=0)  # positions 0..3 evicted
            assert head.n_cached == 0
        with Runner(m, n_ctx=32, type_k="f32", type_v="f32") as rt:
            assert rt.generate(PROMPT + [9], max_tokens=6, temperature=0).tokens == tail.tokens
            assert rt.generate(PROMPT[:4] + [8], max_tokens=6, temperature=0).tokens == head.tokens
    assert tail.tokens == hf_greedy(hf, PROMPT + [9], 6)
    assert head.tokens == hf_greedy(hf, PROMPT[:4] + [8], 6)


def test_graph_reuse_gives_the_same_logits(model):
    outs = {}
    for reuse in (False, True):
        with Runner(model, n_ctx=64, reuse_graphs=reuse, type_k="f32", type_v="f32") as rt:
            rows = [rt.decode(PROMPT)]
            rows += [rt.decode([t]) for t in (3, 1, 4, 1, 5, 9, 2, 6)]
            outs[reuse] = np.concatenate(rows)
            built = rt.graphs_built
        if reuse:
            assert built == 2                 # the prompt's graph and one for every single-token step
        else:
            assert built == 9
    np.testing.assert_array_equal(outs[True], outs[False])


def test_direct_decode_between_requests(model):
    """decode() right after a request waits for the loop's last pipelined batch; the tokens it appended
    to the cleared slot are recorded, so the next request reuses them as its prefix."""
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        ref = rt.generate(PROMPT, max_tokens=4, temperature=0).tokens
        for _ in range(10):
            r = rt.generate(PROMPT, max_tokens=4, temperature=0)
            assert r.tokens == ref
            rt.clear()
            rt.decode(PROMPT[:3], seq=0)
        r = rt.generate(PROMPT, max_tokens=4, temperature=0)
        assert r.n_cached == 3 and r.tokens == ref
        rt.decode_batch(PROMPT[:2], [0, 1], [0, 0], [1])       # positions of its own: the record is dropped
        assert rt.generate(PROMPT, max_tokens=4, temperature=0).n_cached == 0


def test_decode_embeddings_are_the_hidden_states_embed_pools(model):
    """decode(embeddings=True) outputs the rows embed() pools: the final-normed hidden states, not logits,
    continuing the sequence like a logits decode does."""
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        rows = rt.decode(PROMPT, logits="all", embeddings=True)
        step = rt.decode([7], embeddings=True)
        rt.clear()
        full = rt.decode(PROMPT + [7], logits=[0, -1], embeddings=True)
        rt.clear()
        mean = rt.embed(PROMPT, pooling="mean", normalize=False)
        last = rt.embed(PROMPT, pooling="last", normalize=False)
    assert rows.shape == (len(PROMPT), model.config.n_embd) and step.shape == (1, model.config.n_embd)
    np.testing.assert_allclose(rows.mean(0), mean, rtol=0, atol=1e-5 * np.abs(mean).max())
    np.testing.assert_allclose(rows[-1], last, rtol=0, atol=1e-5 * np.abs(last).max())
    np.testing.assert_allclose(full, np.concatenate([rows[:1], step]), rtol=0, atol=1e-5 * np.abs(full).max())


def test_embeddings_of_several_inputs_on_a_decoder(model):
    """A decoder's embeddings of several inputs, queued together, are each input's alone (each a sequence of its
    own through the causal cache, packed into one batch); pooling none gives every row; the pooling types a
    decoder has no head for are refused."""
    inputs = [PROMPT, PROMPT[3:9], [9, 8, 7, 6, 5]]
    with Runner(model, n_ctx=64, n_seq_max=3, type_k="f32", type_v="f32") as rt:
        alone = [rt.embed(x, normalize=False) for x in inputs]
        rt.clear()                        # decode continues what sequence 0 holds (an embedding left it there)
        rows = rt.decode(PROMPT, logits="all", embeddings=True)
        rt.clear()
        before = rt.n_batches
        together = rt.embed(inputs, normalize=False)
        assert rt.n_batches == before + 1 and rt.batch_sizes[-1] == [sum(map(len, inputs))]
        per_token = rt.embed(PROMPT, pooling="none", normalize=False)
        np.testing.assert_allclose(rt.embed(PROMPT, normalize=1), alone[0] / np.abs(alone[0]).sum(), rtol=1e-5)
        with pytest.raises(GGMLValueError, match="not a reranker"):
            rt.rerank("q", ["d"])
        with pytest.raises(GGMLValueError, match="no classification head"):
            rt.embed(PROMPT, pooling="rank")
    np.testing.assert_allclose(together, np.stack(alone), rtol=0, atol=1e-5 * np.abs(together).max())
    np.testing.assert_allclose(per_token, rows, rtol=0, atol=1e-5 * np.abs(rows).max())


@pytest.mark.parametrize("flash", [True, False])
def test_saved_state_continues_exactly_in_another_runner(model, tmp_path, flash):
    """save_state / load_state: a sequence reloaded into another runner (other sequence id, cells elsewhere,
    another sequence already in the cache) gives the logits of the run that never stopped, and a request
    over the saved tokens reuses them as its prefix."""
    path = tmp_path / "seq.state"
    kw = dict(n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32", flash_attn=flash)
    with Runner(model, **kw) as a:
        a.decode(PROMPT[:8], seq=0)
        assert a.save_state(0, path) == path.stat().st_size
        ref = a.decode(PROMPT[8:], seq=0, logits="all")
        ref_gen = a.generate(PROMPT, max_tokens=4, temperature=0).tokens
    with Runner(model, **kw) as b:
        b.decode([9, 8, 7], seq=0)
        assert b.load_state(1, path) == PROMPT[:8] and b.seq_len(1) == 8
        got = b.decode(PROMPT[8:], seq=1, logits="all")
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
        after = model_logits_after(model, [9, 8, 7, 6], kw)     # sequence 0 undisturbed by the load
        np.testing.assert_allclose(b.decode([6], seq=0), after, rtol=0, atol=1e-6 * np.abs(after).max())
    with Runner(model, **kw) as c:
        c.load_state(0, path)
        r = c.generate(PROMPT, max_tokens=4, temperature=0)
        assert r.n_cached == 8 and r.tokens == ref_gen


def model_logits_after(model, tokens, kw):
    with Runner(model, **kw) as rt:
        rt.decode(tokens[:-1], seq=0)
        return rt.decode(tokens[-1:], seq=0)


def test_a_state_of_another_configuration_is_refused_and_changes_nothing(model, tmp_path):
    from ggmlpy.kvcache import StateError

    path = tmp_path / "seq.state"
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as a:
        a.decode(PROMPT, seq=0)
        a.save_state(0, path)
    with Runner(model, n_ctx=64, type_k="f16", type_v="f32") as b:
        b.decode(PROMPT[:3], seq=0)
        with pytest.raises(StateError, match="type_k"):
            b.load_state(0, path)
        assert b.seq_len(0) == 3
        r = b.generate(PROMPT[:3] + [1], max_tokens=1, temperature=0)
        assert r.n_cached == 3                      # the slot's record survived the refusal too
    damaged = tmp_path / "bad.state"
    damaged.write_bytes(path.read_bytes()[:-5])
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as c:
        with pytest.raises(StateError):
            c.load_state(0, damaged)
        assert c.seq_len(0) == 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_admission_compacts_a_fragmented_cache(model, pipeline):
    """Two requests interleave their cells; a third takes one slot and frees its cells, leaving holes between
    the other's: admission compacts the cache (rows move), and a prompt reusing the moved prefix gives what a
    fresh runner gives, as does every request compared to a runner that never compacts."""
    a, b, c = PROMPT, [5, 9, 13, 17, 21, 25, 29, 33], [300, 200, 100, 50]
    outs = {}
    for thold in (None, 0.1):
        with Runner(model, n_ctx=64, n_seq_max=2, n_batch=4, type_k="f32", type_v="f32", pipeline=pipeline,
                    defrag_thold=thold) as rt:
            ha, hb = rt.submit(a, max_tokens=6, temperature=0), rt.submit(b, max_tokens=6, temperature=0)
            ra, rb = ha.result(), hb.result()
            rc = rt.generate(c, max_tokens=4, temperature=0)
            assert rt.n_defrags == (0 if thold is None else 1)
            if thold is not None:
                assert rt.cache.fragmentation() <= 0.1
            kept = rt.slots[0].tokens if rt.slots[0].tokens[:len(b)] == b else rt.slots[1].tokens
            assert kept[:len(b)] == b                     # b's slot survived; a's was taken by c
            rd = rt.generate(kept + [7], max_tokens=5, temperature=0)
            assert rd.n_cached == len(kept)
            outs[thold] = [ra.tokens, rb.tokens, rc.tokens, rd.tokens]
    assert outs[None] == outs[0.1]
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as fresh:
        assert fresh.generate(kept + [7], max_tokens=5, temperature=0).tokens == outs[0.1][3]
