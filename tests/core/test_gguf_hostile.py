"""Hostile or corrupt GGUF metadata: every edit below loaded silently, ran for minutes, or raised an
unnamed ValueError before the checks in ggmlpy.gguf / models/llama.py; each must now be a clear error that
names the file and the key (or tensor), raised before anything is sized from the bad value.

The edits are made on the bytes of a real file (tests/gguf_fuzz.py's Header), so the file is otherwise
well-formed: only the loader's own checks can catch them.
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import pytest
from gguf_fuzz import ARRAY, BF16, F16, STRING, Header, kv_chunk
from helpers import run_child

import ggmlpy
from ggmlpy import gguf
from ggmlpy.gguf import GGUFError, GGUFReader, MetadataError, MetadataTypeError
from ggmlpy.models import MissingTensor, load_model
from ggmlpy.models.synthetic import write_synthetic

EPS = "llama.attention.layer_norm_rms_epsilon"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny F16 llama model (2 layers, n_embd 64, 4/2 heads of 16, ff 192, vocab 512)."""
    return write_synthetic(tmp_path_factory.mktemp("hostile") / "tiny.gguf", size="tiny", type="F16", seed=4)


@pytest.fixture
def edit(base, tmp_path):
    """``edit(fn)``: the base file's bytes transformed by ``fn(Header) -> bytes``, written to a new path."""
    blob = base.read_bytes()

    def make(fn, name="edited.gguf"):
        p = tmp_path / name
        p.write_bytes(fn(Header(blob)))
        return p
    return make


def set_kv(key, t, value):
    def fn(h):
        kvs = list(h.kvs)
        if key in [k for k, *_ in kvs]:
            kvs[h.kv_index(key)] = kv_chunk(key, t, value)
        else:
            kvs.append(kv_chunk(key, t, value))
        return h.build(kvs=kvs)
    return fn


def test_the_base_file_loads_and_decodes(base):
    from ggmlpy.runner import Runner

    with load_model(base, devices="cpu") as m, Runner(m, n_ctx=16) as rt:
        logits = rt.decode([1, 2, 3])
    assert logits.shape[-1] == 512 and np.all(np.isfinite(logits))


# --- hyperparameters against sane bounds and against the file --------------------------------------

def test_huge_block_count_fails_at_once(edit):
    """block_count = 2**31 - 1 used to size the placement (minutes, GBs, then a bare OverflowError)."""
    path = edit(set_kv("llama.block_count", 4, 2**31 - 1))
    # in a child: without the bound this grows memory for minutes (the timeout is a hang detector)
    out = run_child("""
        import sys
        from ggmlpy.models import load_model
        try:
            load_model(sys.argv[1])
        except Exception as e:
            print("ERR", type(e).__name__, getattr(e, "key", None), e)
    """, path, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"ERR MetadataError llama.block_count {path}" in out.stdout, out.stdout
    assert "2147483647 is out of range" in out.stdout


@pytest.mark.parametrize("value,match", [
    (1, r"'llama.block_count': 1, but the file has tensors for 2 layers"),
    (3, r"'llama.block_count': 3, but the file has tensors for 2 layers"),
    (0, r"'llama.block_count': 0 is out of range"),
    (2**32 - 1, r"'llama.block_count': 4294967295 is out of range"),
])
def test_block_count_must_match_the_layers_present(edit, value, match):
    path = edit(set_kv("llama.block_count", 4, value))
    with pytest.raises(MetadataError, match=match) as e:
        load_model(path, devices="cpu")
    assert e.value.key == "llama.block_count" and e.value.path == str(path) and str(path) in str(e.value)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0, -1e-5, 2.0])
def test_rms_eps_must_be_finite_and_in_range(edit, value):
    """rms_eps = inf loaded and every output token was 0."""
    path = edit(set_kv(EPS, 6, value))
    with pytest.raises(MetadataError, match=rf"{path}: metadata '{EPS}': .*(not a finite number|out of range)"):
        load_model(path, devices="cpu")


@pytest.mark.parametrize("key,value,t", [
    ("llama.rope.freq_base", math.nan, 6), ("llama.rope.freq_base", 0.0, 6),
    ("llama.context_length", 2**31, 4), ("llama.context_length", 0, 4),
    ("llama.vocab_size", 2**31 - 1, 4), ("llama.rope.scaling.factor", math.inf, 6),
])
def test_out_of_range_values_name_their_key(edit, key, value, t):
    path = edit(set_kv(key, t, value))
    with pytest.raises(MetadataError) as e:
        load_model(path, devices="cpu")
    assert e.value.key == key and str(path) in str(e.value), str(e.value)


@pytest.mark.parametrize("key,value", [("tokenizer.ggml.bos_token_id", 512),
                                       ("tokenizer.ggml.eos_token_id", 2**32 - 1)])
def test_special_token_ids_outside_the_vocabulary_are_dropped_with_a_warning(edit, key, value, caplog):
    # as llama.cpp ("bad special token ... using default"): the id could never be sampled, and it is
    # never used as an input
    path = edit(set_kv(key, 4, value))
    with caplog.at_level("WARNING", logger="ggmlpy"):
        model = load_model(path, devices="cpu")
    try:
        assert key in caplog.text and "outside the vocabulary" in caplog.text
        if "bos" in key:
            assert model.config.bos_token_id is None
        else:
            assert value not in model.config.eos_token_ids
    finally:
        model.close()


@pytest.mark.parametrize("key,value,tensor", [
    ("llama.embedding_length", 128, None),            # head size 32: attn_q has 64 rows, not 128
    ("llama.vocab_size", 511, "token_embd.weight"),
    ("llama.attention.head_count_kv", 1, "blk.0.attn_k.weight"),
    ("llama.feed_forward_length", 96, "blk.0.ffn_gate.weight"),
    ("llama.attention.key_length", 32, "blk.0.attn_q.weight"),
])
def test_hyperparameters_must_agree_with_the_tensor_shapes(edit, key, value, tensor):
    path = edit(set_kv(key, 4, value))
    with pytest.raises(ggmlpy.GGMLError, match=str(path)) as e:
        load_model(path, devices="cpu")
    assert isinstance(e.value, ValueError)
    if tensor is not None:
        assert tensor in str(e.value) and "ne=" in str(e.value), str(e.value)


# --- wrong types -------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,t,value", [
    ("llama.block_count", STRING, "two"), ("llama.block_count", 6, 2.7), ("llama.block_count", 7, True),
    ("llama.embedding_length", STRING, "64"), (EPS, STRING, "1e-5"),
    ("llama.vocab_size", ARRAY, (4, [512, 512])), ("llama.rope.scaling.type", 4, 3),
])
def test_wrong_metadata_types_name_the_key_and_file(edit, key, t, value):
    """These raised a plain ValueError (int('two')) or were truncated silently (2.7 -> 2 layers)."""
    path = edit(set_kv(key, t, value))
    with pytest.raises(MetadataTypeError) as e:
        load_model(path, devices="cpu")
    err = e.value
    assert isinstance(err, TypeError) and isinstance(err, ValueError) and isinstance(err, ggmlpy.GGMLError)
    assert err.key == key and f"{path}: metadata '{key}'" in str(err), str(err)


def test_per_layer_arrays_must_be_uniform(edit):
    path = edit(set_kv("llama.attention.head_count_kv", ARRAY, (4, [2, 1])))
    with pytest.raises(MetadataError, match=r"'llama.attention.head_count_kv': per-layer values differ \(\[2, 1\]\)"):
        load_model(path, devices="cpu")
    ok = edit(set_kv("llama.attention.head_count_kv", ARRAY, (4, [2, 2])), "uniform.gguf")
    with load_model(ok, devices="cpu") as m:
        assert m.config.n_head_kv == 2


def test_typed_getters_on_the_reader(base):
    with GGUFReader(base) as r:
        assert r.get_int("llama.block_count", lo=1) == 2
        assert r.get_float(EPS, lo=0, lo_open=True) == pytest.approx(1e-5)
        assert r.get_str("general.architecture") == "llama"
        assert r.get_int("nope", 7) == 7
        with pytest.raises(MetadataError, match=r"'nope': is missing"):
            r.get_int("nope")
        with pytest.raises(MetadataTypeError, match=r"'general.architecture': expected an integer, got str"):
            r.get_int("general.architecture")
        with pytest.raises(MetadataError, match=r"'llama.block_count': 2 is out of range \[3, inf\]"):
            r.get_int("llama.block_count", lo=3)


# --- the tensor table against the file ---------------------------------------------------------------

def test_one_tensor_fewer_in_the_header_count(edit):
    """ggml reads the last tensor info as data and shifts every weight; the file's end now disagrees."""
    path = edit(lambda h: h.data[:8] + struct.pack("<Q", len(h.tinfos) - 1) + h.data[16:])
    with pytest.raises(GGUFError, match=r"more bytes .* that no tensor describes: the tensor count"):
        GGUFReader(path)
    with pytest.raises(GGUFError, match=str(path)):
        load_model(path, devices="cpu")


def test_appended_bytes_are_refused_but_padding_is_not(base, tmp_path):
    blob = base.read_bytes()
    (tmp_path / "pad.gguf").write_bytes(blob)
    GGUFReader(tmp_path / "pad.gguf")
    (tmp_path / "long.gguf").write_bytes(blob + bytes(64))
    with pytest.raises(GGUFError, match="64 more bytes"):
        GGUFReader(tmp_path / "long.gguf")
    # a file whose last tensor is not padded to the alignment is fine
    p = tmp_path / "short.gguf"
    with gguf.GGUFWriter(p) as w:
        w.add_tensor("x", np.ones(3, np.float32))
    data = p.read_bytes()
    r = GGUFReader(p)
    p.write_bytes(data[:r.tensors[-1].offset + 12])
    assert GGUFReader(p).tensor_data("x").tolist() == [1, 1, 1]


def test_f16_data_retyped_as_bf16(edit):
    """Same size, so the layout cannot show it: the sampled data has magnitudes no model has."""
    def fn(h):
        i = h.tensor_index("blk.1.ffn_up.weight")
        f = h.tinfo_fields(i)
        assert f["type"] == F16
        tinfos = list(h.tinfos)
        tinfos[i] = (tinfos[i][0], tinfos[i][1][:f["type_at"]] + struct.pack("<I", BF16) +
                     tinfos[i][1][f["type_at"] + 4:])
        return h.build(tinfos=tinfos)
    path = edit(fn)
    with pytest.raises(GGUFError, match=r"'blk.1.ffn_up.weight' does not look like BF16 data: the median magnitude"):
        load_model(path, devices="cpu")


@pytest.mark.parametrize("bits,what", [(0x7E00, "nan"), (0x7C00, "inf")])
def test_non_finite_weights_are_refused(edit, bits, what):
    def fn(h):
        f = h.tinfo_fields(h.tensor_index("blk.0.attn_q.weight"))
        at = h.data_start + f["offset"] + 2 * 64 * 63        # the last row is sampled too
        return h.data[:at] + struct.pack("<H", bits) + h.data[at + 2:]
    path = edit(fn)
    with pytest.raises(GGUFError, match=rf"'blk.0.attn_q.weight' \(F16\) holds non-finite values .*{what}"):
        load_model(path, devices="cpu")


def test_every_tensor_must_be_used(base, tmp_path):
    """A tensor the hyperparameters do not account for (here an extra bias) is an error, not ignored."""
    p = tmp_path / "extra.gguf"
    with GGUFReader(base) as rd, gguf.GGUFWriter(p) as w:
        for k, v in rd.metadata.items():
            w.add(k, v, rd.kv_type(k))
        for t in rd.tensors:
            w.add_tensor(t.name, rd.tensor_data(t.name), type=t.type)
        w.add_tensor("blk.0.attn_k.bias", np.zeros(32, np.float32))
    with pytest.raises(GGUFError, match=r"1 tensor\(s\) of the file are not used .*blk.0.attn_k.bias"):
        load_model(p, devices="cpu")


def test_missing_layer_tensors(edit, tmp_path):
    def fn(h):          # blk.1.attn_norm.weight renamed blk.3.attn_norm.weight: layer 2 is absent
        i = h.tensor_index("blk.1.attn_norm.weight")
        name, chunk = h.tinfos[i]
        tinfos = list(h.tinfos)
        tinfos[i] = ("blk.3.attn_norm.weight", chunk.replace(b"blk.1.", b"blk.3.", 1))
        return h.build(tinfos=tinfos)
    path = edit(fn)
    with pytest.raises(MetadataError, match=r"'llama.block_count': 2, but the file has tensors for 4 layers"):
        load_model(path, devices="cpu")
    # the same file with a matching block_count: layer 2 has no tensors at all
    h = Header(path.read_bytes())
    four = tmp_path / "four.gguf"
    four.write_bytes(set_kv("llama.block_count", 4, 4)(h))
    with pytest.raises(MissingTensor, match=r"no tensors for layers \[2\] of 4"):
        load_model(four, devices="cpu")


# --- tensor data: copies, and files that change under a mapping ------------------------------------

def test_tensor_data_copy_survives_truncation(base, tmp_path):
    p = tmp_path / "t.gguf"
    p.write_bytes(base.read_bytes())
    r = GGUFReader(p)
    name = "output.weight"
    want = r.tensor_data(name).copy()
    c = r.tensor_data(name, copy=True)
    assert c.flags.writeable
    np.testing.assert_array_equal(c, want)
    assert not np.shares_memory(c, r.tensor_data(name))
    os.truncate(p, r.tensors[-1].offset - 100)
    # the copy is independent of the file; new reads of either kind see the truncation and raise
    np.testing.assert_array_equal(c, want)
    with pytest.raises(GGUFError, match="truncated after opening"):
        r.tensor_data(name, copy=True)
    with pytest.raises(GGUFError, match="truncated after opening"):
        r.tensor_data(name)
    r.close()
    with pytest.raises(GGUFError, match="closed"):
        r.tensor_data(name, copy=True)


def test_check_tensors_finds_a_nan_in_any_row(edit):
    """A NaN in a row the sample skips loads by default (documented); check_tensors finds it and names the row."""
    def fn(h):
        f = h.tinfo_fields(h.tensor_index("token_embd.weight"))
        at = h.data_start + f["offset"] + 2 * (64 * 100 + 5)        # row 100, column 5 of 512 rows
        return h.data[:at] + struct.pack("<H", 0x7E00) + h.data[at + 2:]
    path = edit(fn)
    load_model(path, devices="cpu").close()
    with pytest.raises(GGUFError, match=r"'token_embd.weight' \(F16\) holds non-finite values .* row 100, column 5"):
        load_model(path, check_tensors=True, devices="cpu")


# --- mmproj (vision encoder) files -------------------------------------------------------------------

@pytest.fixture(scope="module")
def mmproj_bases(tmp_path_factory):
    """Tiny gemma3 and idefics3 encoders in the converter's layout (tests/gguf_fuzz.py's write_mmproj)."""
    from gguf_fuzz import write_mmproj

    d = tmp_path_factory.mktemp("mmproj")
    return {p: write_mmproj(d / f"{p}.gguf", p, "F32") for p in ("gemma3", "idefics3")}


def _mm_edit(src, dst, fn):
    dst.write_bytes(fn(Header(src.read_bytes())))
    return dst


def test_the_mmproj_bases_load_and_encode(mmproj_bases):
    from ggmlpy.vision import load_mmproj

    for proj, path in mmproj_bases.items():
        with load_mmproj(path) as vm:
            out = vm.encode(np.zeros((1, 3, 64, 64), np.float32))
        assert out.shape == (1, 16, 64) and np.all(np.isfinite(out)), proj


# each loaded silently on b1aaa0d: an encoder computing something else than the file's model, or
# settings no image processor has
@pytest.mark.parametrize("proj,key,t,value,match", [
    ("gemma3", "clip.vision.attention.layer_norm_epsilon", 6, 0.0, r"0 is out of range \(0"),
    ("gemma3", "clip.use_gelu", 7, False, "quick GELU"),
    ("idefics3", "clip.use_gelu", None, None, "quick GELU"),                  # removed: llama.cpp's quick GELU
    ("gemma3", "clip.use_silu", 7, True, "SiLU"),
    ("gemma3", "clip.use_gelu", 4, 1, "expected a bool, got int"),
    ("idefics3", "clip.has_vision_encoder", STRING, "true", "expected a bool, got str"),
    ("gemma3", "clip.vision.image_mean", STRING, "000", "expected an array of 3 numbers, got str"),
    ("gemma3", "clip.vision.image_mean", ARRAY, (STRING, ["0.5"] * 3), "expected an array of 3 numbers"),
    ("idefics3", "clip.vision.image_std", ARRAY, (7, [True] * 3), "expected an array of 3 numbers"),
    ("gemma3", "clip.vision.image_std", ARRAY, (6, [0.5, 0.5, 1e-9]), r"out of range.*\[0.001, 1\]"),
    ("idefics3", "clip.vision.image_mean", ARRAY, (6, [0.5, 2.0, 0.5]), r"out of range.*\[0, 1\]"),
    ("idefics3", "clip.vision.preproc_image_size", 4, 5000, r"5000 is out of range \[1, 4096\]"),
])
def test_mmproj_metadata_that_must_be_refused(mmproj_bases, tmp_path, proj, key, t, value, match):
    from ggmlpy.vision import load_mmproj

    def fn(h):
        if t is None:
            return h.build(kvs=[x for x in h.kvs if x[0] != key])
        return set_kv(key, t, value)(h)
    path = _mm_edit(mmproj_bases[proj], tmp_path / "edited.gguf", fn)
    with pytest.raises(MetadataError, match=match) as e:
        load_mmproj(path)
    assert e.value.key == key and f"{path}: metadata '{key}'" in str(e.value), str(e.value)


def test_mmproj_vision_projector_type_wins(mmproj_bases, tmp_path):
    """A mixed-modality file's clip.vision.projector_type is the vision projector (as in llama.cpp and the
    preprocessing); on b1aaa0d the encoder read clip.projector_type alone and built the other projector."""
    from ggmlpy.vision import load_mmproj

    path = _mm_edit(mmproj_bases["gemma3"], tmp_path / "mixed.gguf",
                    set_kv("clip.vision.projector_type", STRING, "idefics3"))
    with pytest.raises(MissingTensor, match=rf"{path}: tensor 'mm.model.fc.weight' is missing \(the idefics3"):
        load_mmproj(path)
    same = _mm_edit(mmproj_bases["gemma3"], tmp_path / "same.gguf",
                    set_kv("clip.vision.projector_type", STRING, "gemma3"))
    load_mmproj(same).close()
    unknown = _mm_edit(mmproj_bases["gemma3"], tmp_path / "unknown.gguf",
                       set_kv("clip.vision.projector_type", STRING, "cogvlm"))
    with pytest.raises(MetadataError, match="'cogvlm' is not supported") as e:
        load_mmproj(unknown)
    assert e.value.key == "clip.vision.projector_type"


def test_mmproj_f16_position_embeddings_are_refused_at_load(mmproj_bases, tmp_path):
    """On b1aaa0d an F16 v.position_embd.weight loaded, and every encode then failed inside the graph with
    an error naming neither the tensor nor the file."""
    from ggmlpy.vision import load_mmproj

    p = tmp_path / "pos16.gguf"
    with GGUFReader(mmproj_bases["gemma3"]) as rd, gguf.GGUFWriter(p) as w:
        for k, v in rd.metadata.items():
            w.add(k, v, rd.kv_type(k))
        for t in rd.tensors:
            f16 = t.name == "v.position_embd.weight"
            w.add_tensor(t.name, rd.tensor_data(t.name), type=gguf.Type.F16 if f16 else t.type)
    with pytest.raises(MissingTensor, match=rf"{p}: tensor 'v.position_embd.weight' is F16, expected F32"):
        load_mmproj(p)


@pytest.mark.fuzz
def test_hostile_mmproj_files_never_abort_and_semantic_edits_never_load(tmp_path):
    """A sample of ``tests/gguf_fuzz.py --target mmproj`` (the long run is documented there): structural
    corruption and semantic edits of the clip.* metadata and the encoder's tensors, through GGUFReader,
    load_mmproj, an encode and a Runner reserving for the encoder, in child processes: no abort, no hang,
    every semantic edit rejected, every error a GGMLError naming the file."""
    import gguf_fuzz

    n = int(os.environ.get("GGMLPY_MMPROJ_FUZZ_CASES", "300"))
    s = gguf_fuzz.run(n, seed=13, jobs=1, batch=150, case_timeout=20.0, work=str(tmp_path), target="mmproj")
    assert s["cases"] == n and not s["failures"], s["failures"]
    assert s["aborts"] == s["hangs"] == s["bad_exceptions"] == s["unnamed_errors"] == 0, s
    assert s["silent_semantic_loads"] == 0 and s["semantic"] > n // 5 and s["semantic_rejected"] == s["semantic"], s
    assert s["loaded"] > 0 and s["rejected"] > n // 2, s
    if n >= 300:
        assert set(gguf_fuzz.SEMANTIC_MMPROJ) <= set(s["by_kind"]), sorted(s["by_kind"])
