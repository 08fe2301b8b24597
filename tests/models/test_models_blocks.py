"""models/blocks.py against numpy on small tensors, and the decoder base (models/config.py, models/decoder.py): its
metadata reader, its config hooks and the errors a subclass gets for free."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

import ggmlpy
from ggmlpy import GGMLValueError, RopeType, Type
from ggmlpy.gguf import GGUFError, GGUFReader, MetadataError, MetadataTypeError
from ggmlpy.kvcache import Causal
from ggmlpy.models import (
    DecoderConfig,
    DecoderModel,
    LlamaConfig,
    LlamaModel,
    MetaReader,
    MissingTensor,
    blocks,
)
from ggmlpy.models.synthetic import write_synthetic

RNG = np.random.default_rng(7)


def rand(*shape, scale=1.0) -> np.ndarray:
    """Random float32 values in numpy order (ggml's ``ne`` is the reverse)."""
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def run(ctx, *outs) -> list[np.ndarray]:
    """Compute ``outs`` (and anything they depend on) in ``ctx``; their values in numpy order."""
    gf = ctx.new_graph(1024)
    for t in outs:
        gf.build_forward_expand(t)
    gf.compute(2)
    return [t.numpy().copy() for t in outs]


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# --------------------------------------------------------------------------------------------- norms, RoPE


def test_rms_norm_and_norm_match_numpy():
    x, wt, b = rand(5, 16), rand(16), rand(16)
    with ggmlpy.Context(1 << 20) as ctx:
        tx, tw, tb = (ctx.from_numpy(a) for a in (x, wt, b))
        got = run(ctx, blocks.rms_norm(ctx, tx, tw, 1e-6), blocks.norm(ctx, tx, tw, tb, eps=1e-5),
                  blocks.norm(ctx, tx, tw, eps=1e-5))
    rms = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * wt
    ln = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * wt
    for g, want in zip(got, (rms, ln + b, ln)):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", [RopeType.NORMAL, RopeType.NEOX])
def test_rope_uses_the_config_settings(mode):
    """Positions rotate pairs of dimensions (adjacent for NORMAL, halves for NEOX) at base ** (-2i / d)."""
    n, n_head, hd, base = 4, 2, 8, 500.0
    cfg = SimpleNamespace(rope_dim=hd, rope_mode=int(mode), n_ctx_orig=2048, rope_base=base, rope_freq_scale=1.0,
                          rope_ext_factor=0.0, rope_attn_factor=1.0)
    x, pos = rand(n, n_head, hd), np.array([0, 3, 7, 100], np.int32)
    with ggmlpy.Context(1 << 20) as ctx:
        (got,) = run(ctx, blocks.rope(ctx, ctx.from_numpy(x), ctx.from_numpy(pos), cfg))
    theta = pos[:, None, None] * base ** (-2.0 * np.arange(hd // 2) / hd)
    a, b = (x[..., 0::2], x[..., 1::2]) if mode == RopeType.NORMAL else (x[..., :hd // 2], x[..., hd // 2:])
    ra, rb = a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)
    want = np.empty_like(x)
    if mode == RopeType.NORMAL:
        want[..., 0::2], want[..., 1::2] = ra, rb
    else:
        want[..., :hd // 2], want[..., hd // 2:] = ra, rb
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("yarn", [False, True])
def test_rope_shift_is_a_pure_rotation(yarn):
    """Keys rotated at p, then shifted by d, equal keys rotated at p + d: also with YaRN, whose magnitude
    scale (attn_factor 0.9 times ggml's 1 + 0.1 ln 4) the forward pass applies once and a shift must not
    apply again (a second rope() does, by 1.03x here)."""
    n, n_head, hd = 5, 2, 16
    cfg = SimpleNamespace(rope_dim=hd, rope_mode=int(RopeType.NEOX), n_ctx_orig=64, rope_base=10000.0,
                          rope_freq_scale=0.25 if yarn else 1.0, rope_ext_factor=1.0 if yarn else 0.0,
                          rope_attn_factor=0.9 if yarn else 1.0)
    x, p, d = rand(n, n_head, hd), np.array([0, 5, 9, 40, 63], np.int32), np.array([-3, 2, 7, -40, 100], np.int32)
    with ggmlpy.Context(1 << 22) as ctx:
        k = blocks.rope(ctx, ctx.from_numpy(x), ctx.from_numpy(p), cfg)
        dt = ctx.from_numpy(d)
        shifted, twice, direct = (blocks.rope_shift(ctx, k, dt, cfg), blocks.rope(ctx, k, dt, cfg),
                                  blocks.rope(ctx, ctx.from_numpy(x), ctx.from_numpy(p + d), cfg))
        got, again, want = run(ctx, shifted, twice, direct)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    ratio = np.linalg.norm(again) / np.linalg.norm(want)
    assert ratio == pytest.approx(0.9 * (1 + 0.1 * math.log(4)) if yarn else 1.0, rel=1e-3)


# --------------------------------------------------------------------------------------------- Q/K/V


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_from_separate_or_fused_weights(fused, bias):
    """Both forms give the heads of x @ W.T (+ b); from a fused matrix they are strided views of one product."""
    n, n_embd, n_head, n_head_kv, hd = 3, 16, 4, 2, 4
    W = {x: rand(h * hd, n_embd, scale=0.3) for x, h in zip("qkv", (n_head, n_head_kv, n_head_kv))}
    B = {x: rand(W[x].shape[0]) for x in "qkv"}
    x = rand(n, n_embd)
    with ggmlpy.Context(1 << 20) as ctx:
        if fused:
            w = {"blk.0.attn_qkv.weight": ctx.from_numpy(np.concatenate([W[x] for x in "qkv"]))}
            if bias:
                w["blk.0.attn_qkv.bias"] = ctx.from_numpy(np.concatenate([B[x] for x in "qkv"]))
        else:
            w = {f"blk.0.attn_{x}.weight": ctx.from_numpy(W[x]) for x in "qkv"}
            if bias:
                w.update({f"blk.0.attn_{x}.bias": ctx.from_numpy(B[x]) for x in "qkv"})
        q, k, v = blocks.qkv(ctx, w, "blk.0.", ctx.from_numpy(x), n_head, n_head_kv, hd)
        assert (q.ne, k.ne, v.ne) == ((hd, n_head, n, 1), (hd, n_head_kv, n, 1), (hd, n_head_kv, n, 1))
        assert q.is_contiguous != fused
        got = run(ctx, *(ctx.cont(t) for t in (q, k, v)))
    for g, c, h in zip(got, "qkv", (n_head, n_head_kv, n_head_kv)):
        want = x @ W[c].T + (B[c] if bias else 0)
        np.testing.assert_allclose(g, want.reshape(n, h, hd), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- attention


def attention_np(q, ks, vs, q_pos, k_pos, scale):
    """Causal grouped-query attention: q (n, n_head, hd) at q_pos over keys/values (m, n_head_kv, hd) at k_pos."""
    g = q.shape[1] // ks.shape[1]
    out = np.empty_like(q)
    for i, p in enumerate(q_pos):
        seen = k_pos <= p
        for h in range(q.shape[1]):
            a = softmax(scale * ks[seen, h // g] @ q[i, h])
            out[i, h] = a @ vs[seen, h // g]
    return out.reshape(len(q_pos), -1)


@pytest.mark.parametrize("flash", [False, True])
def test_attention_through_a_cache_matches_numpy(flash):
    """A prompt, then two one-token steps, through a Causal cache laid out for the path (V transposed
    without flash attention): each step writes its K/V and attends over everything so far."""
    n_head, n_head_kv, hd = 4, 2, 16
    cache = Causal(1, hd * n_head_kv, hd * n_head_kv, Type.F32, n_head_kv=n_head_kv, padding=256 if flash else 32,
                   v_trans=not flash)
    cache.init(32, 1, 8)
    scale = 1.0 / math.sqrt(hd)
    ks, vs, pos_all = [], [], []
    try:
        for positions in (np.arange(6), np.array([6]), np.array([7])):
            n = positions.size
            q, k, v = rand(n, n_head, hd), rand(n, n_head_kv, hd), rand(n, n_head_kv, hd)
            ks.append(k)
            vs.append(v)
            pos_all.append(positions)
            plan = cache.start_forward(positions, [0] * n)
            with ggmlpy.Context(8 << 20) as ctx:
                memory = cache.forward(ctx, plan)
                o = blocks.attention(ctx, memory, 0, ctx.from_numpy(q), ctx.from_numpy(k), ctx.from_numpy(v),
                                     scale=scale, flash_attn=flash)
                assert o.ne[:2] == (hd * n_head, n)
                gf = ctx.new_graph(256)
                for t in memory.pending:         # the writes first, as DecoderModel.build does
                    gf.build_forward_expand(t)
                gf.build_forward_expand(o)
                gf.compute(2)
                got = o.numpy().copy()
            cache.apply(plan)
            want = attention_np(q, np.concatenate(ks), np.concatenate(vs), positions, np.concatenate(pos_all), scale)
            np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4)
    finally:
        cache.close()


# --------------------------------------------------------------------------------------------- feed-forward


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gated_ffn_matches_numpy(fused, act):
    n, n_embd, n_ff = 3, 16, 24
    Wg, Wu, Wd, x = rand(n_ff, n_embd, scale=0.3), rand(n_ff, n_embd, scale=0.3), rand(n_embd, n_ff, scale=0.3), \
        rand(n, n_embd)
    with ggmlpy.Context(1 << 20) as ctx:
        w = {"blk.1.ffn_down.weight": ctx.from_numpy(Wd)}
        if fused:
            w["blk.1.ffn_gate_up.weight"] = ctx.from_numpy(np.concatenate([Wg, Wu]))
        else:
            w["blk.1.ffn_gate.weight"], w["blk.1.ffn_up.weight"] = ctx.from_numpy(Wg), ctx.from_numpy(Wu)
        (got,) = run(ctx, blocks.ffn_glu(ctx, w, "blk.1.", ctx.from_numpy(x), act=act))
    f = silu if act == "silu" else gelu_tanh
    want = (f(x @ Wg.T) * (x @ Wu.T)) @ Wd.T
    # ggml's CPU GELU reads a float16 table: about 1e-3 relative
    tol = 1e-5 if act == "silu" else 3e-3
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def moe_np(x, Wr, Wg, Wu, Wd, k, norm_weights):
    """Softmax routing, the k most probable experts per token, their gated FFNs summed by probability."""
    probs = softmax(x @ Wr.T)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[:k]
        wts = probs[t, top] / (probs[t, top].sum() if norm_weights else 1.0)
        for e, wt in zip(top, wts):
            out[t] += wt * ((silu(Wg[e] @ x[t]) * (Wu[e] @ x[t])) @ Wd[e].T)
    return out


@pytest.mark.parametrize("k,norm_weights", [(2, True), (2, False), (3, True), (1, False)])
def test_moe_ffn_matches_numpy(k, norm_weights):
    n, n_embd, n_ff, n_expert = 5, 16, 12, 4
    Wr = rand(n_expert, n_embd)
    Wg, Wu = rand(n_expert, n_ff, n_embd, scale=0.3), rand(n_expert, n_ff, n_embd, scale=0.3)
    Wd, x = rand(n_expert, n_embd, n_ff, scale=0.3), rand(n, n_embd)
    with ggmlpy.Context(4 << 20) as ctx:
        w = {f"blk.0.{name}.weight": ctx.from_numpy(a) for name, a in
             (("ffn_gate_inp", Wr), ("ffn_gate_exps", Wg), ("ffn_up_exps", Wu), ("ffn_down_exps", Wd))}
        out = blocks.moe_ffn(ctx, w, "blk.0.", ctx.from_numpy(x), n_expert_used=k, norm_weights=norm_weights)
        assert out.ne[:2] == (n_embd, n)
        (got,) = run(ctx, ctx.cont(out))
    want = moe_np(x, Wr, Wg, Wu, Wd, k, norm_weights)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_ffn_arguments_are_checked():
    with ggmlpy.Context(1 << 20) as ctx:
        x = ctx.from_numpy(rand(2, 8))
        with pytest.raises(GGMLValueError, match="activation 'relu' is not supported"):
            blocks.ffn_glu(ctx, {}, "blk.0.", x, act="relu")
        w = {f"blk.0.{nm}.weight": ctx.from_numpy(rand(*s)) for nm, s in
             (("ffn_gate_inp", (4, 8)), ("ffn_gate_exps", (4, 6, 8)), ("ffn_up_exps", (4, 6, 8)),
              ("ffn_down_exps", (4, 8, 6)))}
        with pytest.raises(GGMLValueError, match=r"n_expert_used must be in \[1, 4\] \(got 5\)"):
            blocks.moe_ffn(ctx, w, "blk.0.", x, n_expert_used=5)


# --------------------------------------------------------------------------------------------- output head


@pytest.mark.parametrize("tied", [False, True])
def test_output_head_tied_or_not_and_embeddings(tied):
    n, n_embd, n_vocab, eps = 2, 8, 11, 1e-5
    x, norm_w, emb, head = rand(n, n_embd), rand(n_embd), rand(n_vocab, n_embd), rand(n_vocab, n_embd)
    with ggmlpy.Context(1 << 20) as ctx:
        w = {"output_norm.weight": ctx.from_numpy(norm_w), "token_embd.weight": ctx.from_numpy(emb)}
        if not tied:
            w["output.weight"] = ctx.from_numpy(head)
        tx = ctx.from_numpy(x)
        logits, hidden = run(ctx, blocks.output(ctx, w, tx, eps), blocks.output(ctx, w, tx, eps, embeddings=True))
    normed = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * norm_w
    np.testing.assert_allclose(hidden, normed, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, normed @ (emb if tied else head).T, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------- decoder base


def test_meta_reader_names_the_key_and_the_file():
    md = {"general.architecture": "qwen3", "qwen3.block_count": 0, "qwen3.rope.freq_base": "big",
          "qwen3.attention.head_count": [8, 8], "qwen3.feed_forward_length": [8, 16], "general.file_type": 7}
    m = MetaReader(md, "qwen3", "m.gguf")
    assert m.key("block_count") == "qwen3.block_count" and m.key("tokenizer.ggml.eos_token_id") == \
        "tokenizer.ggml.eos_token_id"
    assert m.geti("general.file_type") == 7 and m.geti("context_length", 4096) == 4096
    assert m.geti("attention.head_count") == 8          # a per-layer array of one value
    assert "block_count" in m and "context_length" not in m
    with pytest.raises(MetadataError, match=r"m\.gguf.*'qwen3\.block_count'.*\[1, "):
        m.geti("block_count", lo=1)
    with pytest.raises(MetadataError, match=r"m\.gguf: metadata 'qwen3\.embedding_length': is missing"):
        m.geti("embedding_length")
    with pytest.raises(MetadataTypeError, match=r"'qwen3\.rope\.freq_base'"):
        m.getf("rope.freq_base")
    with pytest.raises(MetadataError, match=r"'qwen3\.feed_forward_length'"):
        m.geti("feed_forward_length")                 # layers of different sizes are not built


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("blocks") / "tiny.gguf", size="tiny", type="F16")


def test_a_config_subclass_is_a_few_lines(tiny):
    """An architecture's config names its architectures and adds its keys; the base reads the rest."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class MoEConfig(DecoderConfig):
        ROPE_TYPES = {"llama": RopeType.NORMAL}
        READS_EXPERTS = True
        n_expert: int = 0

        @classmethod
        def _read(cls, m, n_vocab):
            return dict(super()._read(m, n_vocab), n_expert=m.geti("expert_count", 0, lo=0, hi=512))

        def _problems(self):
            return super()._problems() + ([f"{self.arch}.expert_count must be > 0"] if not self.n_expert else [])

    with GGUFReader(tiny) as rd:
        md = dict(rd.metadata)
    c = MoEConfig.from_metadata(md, "t.gguf")
    assert (c.n_layer, c.n_embd, c.n_expert, c.rope_mode) == (2, 64, 0, RopeType.NORMAL)
    with pytest.raises(GGMLValueError, match="bad hyperparameters: llama.expert_count must be > 0"):
        c.validate()
    assert MoEConfig.from_metadata(dict(md, **{"llama.expert_count": 8})).n_expert == 8
    plain = type("PlainConfig", (DecoderConfig,), {"ROPE_TYPES": {"llama": RopeType.NORMAL}})
    with pytest.raises(ggmlpy.models.UnknownArchitecture, match=r"\(llama\.expert_count = 8\)"):
        plain.from_metadata(dict(md, **{"llama.expert_count": 8}), "t.gguf")   # experts it would not build
    with pytest.raises(ggmlpy.models.UnknownArchitecture, match="'qwen2' is not one MoEConfig reads"):
        MoEConfig.from_metadata(dict(md, **{"general.architecture": "qwen2"}), "t.gguf")


def test_a_subclass_is_checked_against_the_file(tiny):
    """The base refuses a file whose tensors the subclass does not all read, and names a missing one."""

    class Partial(LlamaModel):          # reads only the embeddings and the head
        def _expected(self):
            yield from self._expected_io()

    class Greedy(LlamaModel):           # wants a tensor the file lacks
        def _expected(self):
            yield from super()._expected()
            yield "blk.0.attn_q_norm.weight", (16,), 0, (Type.F32,), None

    with GGUFReader(tiny) as rd, pytest.raises(GGUFError, match=r"tensor\(s\) of the file are not used by llama.*"
                                                                    r"blk\.0\.attn_norm\.weight"):
        Partial(rd)
    with GGUFReader(tiny) as rd, pytest.raises(MissingTensor, match="'blk.0.attn_q_norm.weight' is missing "
                                                                    r"\(llama needs it\)"):
        Greedy(rd)
    with GGUFReader(tiny) as rd, pytest.raises(NotImplementedError, match="must yield its tensors"):
        type("Bare", (DecoderModel,), {"config_class": LlamaConfig})(rd)


def test_the_base_builds_the_frame_and_the_subclass_the_body(tiny):
    """build() makes the inputs and the graph around _forward; a subclass without one says so."""
    with GGUFReader(tiny) as rd:
        model = type("NoBody", (LlamaModel,), {"_forward": DecoderModel._forward})(rd, repack=False)
        try:
            assert model.desc.startswith("llama ") and repr(model).startswith("NoBody('llama ")
            assert model.graph_size() == 64 * 2 + 256 and model.backend_names == "CPU"
            cache = model.new_cache(Type.F32, Type.F32)
            cache.init(16, 1, 4)
            plan = cache.start_forward(np.arange(4), [0] * 4, reserve=True)
            with pytest.raises(NotImplementedError, match="must build its graph in _forward"):
                model.build(cache, plan, 4, 1)
            with pytest.raises(GGMLValueError, match=r"n_out 5 must be in \[1, n_tokens=4\]"):
                model.build(cache, plan, 4, 5)
            cache.close()
        finally:
            model.close()
