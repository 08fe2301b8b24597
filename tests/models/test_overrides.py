"""Tensor overrides (``load_model(tensor_overrides=..., n_cpu_moe=...)``, llama.cpp's ``-ot`` and
``--n-cpu-moe``): weights by name on another device than their layer's, here between the CPU and a real
``ggmlpy rpc-server`` on loopback (a CPU behind ggml's RPC backend, so the logits of any placement
equal the CPU's to float32 rounding, test_arch_rpc's bound). Each test checks where every weight is
(host memory or the server's), what the memory report counts on each device, and the logits."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_arch_rpc import TOL, _same_kernels  # noqa: F401  (ggml's kernels on both sides)
from test_arch_rpc import files as arch_files  # noqa: F401  (a fixture: each architecture's F32 file)
from test_core_backend import rpc_server  # noqa: F401  (a fixture: an RPC server on loopback)

from ggmlpy import _core
from ggmlpy._core import GGMLValueError
from ggmlpy.backend import n_cpu_moe_overrides, parse_tensor_overrides
from ggmlpy.models import load_model
from ggmlpy.runner import Runner

PROMPT = [13, 17, 250, 3, 99, 42, 7, 300, 128, 64, 11]
EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def _logits(model) -> np.ndarray:
    with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
        return np.concatenate([rt.decode(PROMPT, logits="all"), rt.decode([23]), rt.decode([311])])


def _close(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert float((np.abs(got - ref).max(-1) / np.abs(ref).max(-1)).max()) <= TOL


def _server(ep: str):
    return _core.rpc_add_server(ep)[0]


# --------------------------------------------------------------------------- parsing, refusals


def test_parse_names_devices_and_buffer_types_in_any_case():
    cpu = _core.device("CPU")
    assert parse_tensor_overrides("ffn_.*_exps=CPU,attn=cpu") == (("ffn_.*_exps", cpu), ("attn", cpu))
    assert parse_tensor_overrides(["a=CPU", ("b", "Cpu"), ("c", cpu)]) == (("a", cpu), ("b", cpu), ("c", cpu))
    assert parse_tensor_overrides(None) == () and parse_tensor_overrides("") == ()
    # one per layer, as llama.cpp's --n-cpu-moe; more than the layers is all of them
    ncmoe = n_cpu_moe_overrides(99, 3)
    assert [p for p, _ in ncmoe] == [rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps" for i in range(3)]
    assert re.search(ncmoe[1][0], "blk.1.ffn_gate_up_exps.weight") and re.search(ncmoe[1][0], "blk.1.ffn_up_exps.bias")
    assert not re.search(ncmoe[1][0], "blk.11.ffn_up_exps.weight") and not re.search(ncmoe[1][0], "blk.1.ffn_up.weight")


@pytest.mark.parametrize("kw, message", [
    ({"tensor_overrides": "ffn_(=CPU"}, r"pattern 'ffn_\(' is not a regular expression"),
    ({"tensor_overrides": "ffn_up"}, r"'ffn_up' is not PATTERN=DEVICE"),
    ({"tensor_overrides": "=CPU"}, r"'=CPU' is not PATTERN=DEVICE"),
    ({"tensor_overrides": "ffn_up=CUDA7"}, r"unknown device or buffer type 'CUDA7' \(this process has: .*CPU"),
    ({"n_cpu_moe": -1}, r"n_cpu_moe must be an integer >= 0 \(got -1\)"),
    ({"n_cpu_moe": True}, r"n_cpu_moe must be an integer >= 0"),
    ({"n_cpu_moe": "2"}, r"n_cpu_moe must be an integer >= 0"),
])
@pytest.mark.parametrize("ngl", [-1, "auto"])
def test_bad_overrides_are_refused_before_anything_is_read(arch_files, kw, message, ngl, monkeypatch):  # noqa: F811
    path = arch_files("llama")
    opened = []
    monkeypatch.setattr("ggmlpy.load.open_reader", lambda *a, **k: opened.append(a) or 1 / 0)
    with pytest.raises(GGMLValueError, match=message):
        load_model(path, n_gpu_layers=ngl, **kw)
    assert opened == []


def test_a_pattern_matching_no_weight_is_warned_about(arch_files):  # noqa: F811
    with pytest.warns(UserWarning, match=r"tensor override pattern\(s\) ffn_uup match no weight of this llama"):
        load_model(arch_files("llama"), tensor_overrides="ffn_up=CPU,ffn_uup=CPU", devices="cpu").close()
    with pytest.warns(UserWarning, match=r"n_cpu_moe \(--cpu-moe, -ncmoe\): this llama model has no expert weights"):
        load_model(arch_files("llama"), n_cpu_moe=1, devices="cpu").close()


# --------------------------------------------------------------------------- placements (rpc)


@pytest.mark.rpc
def test_n_cpu_moe_keeps_the_first_layers_experts_on_the_cpu(arch_files, rpc_server):  # noqa: F811
    """Every layer on the server but layer 0's experts (``n_cpu_moe=1``): those three weights in host
    memory, counted on the CPU under layer 0 in the memory report and missing from the server's; the
    scheduler runs layer 0's expert products on the CPU; the logits are the CPU's."""
    path = arch_files("qwen3moe")
    with load_model(path, devices="cpu") as model:
        ref = _logits(model)
        whole = {name: t.nbytes for name, (t, _) in model.weights.tensors.items()}
    remote = _server(rpc_server)
    with load_model(path, devices="auto", rpc=[rpc_server], n_gpu_layers=99, n_cpu_moe=1) as model:
        assert model.config.n_layer == 2 and all(d == remote for d in model.placement.layers)
        moved = {n for n in model.weights.tensors if (m := EXPERTS.fullmatch(n)) and m.group(1) == "0"}
        assert len(moved) == 3 and model.weights.overridden == dict.fromkeys(moved, "CPU")
        for name, (t, _) in model.weights.tensors.items():
            assert t.is_host == (name in moved or name == "token_embd.weight"), name
        rep = model.report.devices
        assert rep["CPU"].weights[0] == sum(whole[n] for n in moved)
        assert rep[remote.name].weights[0] == sum(v for n, v in whole.items() if n.startswith("blk.0.")) \
            - rep["CPU"].weights[0]
        assert 1 not in rep["CPU"].weights
        assert "tensor overrides blk\\.0\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU" in model.placement.summary()
        _close(_logits(model), ref)
    # more than the layers: every layer's experts (llama.cpp's --cpu-moe), without a warning
    with load_model(path, devices="auto", rpc=[rpc_server], n_gpu_layers=99, n_cpu_moe=99) as model:
        assert set(model.weights.overridden) == {n for n in model.weights.tensors if EXPERTS.fullmatch(n)}


@pytest.mark.rpc
def test_overrides_send_cpu_layers_weights_to_a_server_and_keep_fused_parts_together(arch_files, rpc_server):  # noqa: F811
    """Every layer on the CPU (``n_gpu_layers=0``) but the weights the patterns name on the server (named
    by its buffer type's name, as llama.cpp's -ot takes it). Gate and up go together, so they still fuse;
    an override of K alone keeps Q, K and V apart in every layer. The logits are the CPU's."""
    path = arch_files("llama")
    with load_model(path, devices="cpu") as model:
        ref = _logits(model)
        assert {"blk.0.attn_qkv.weight", "blk.0.ffn_gate_up.weight"} <= set(model.fused)
    remote = _server(rpc_server)
    spec = f"ffn_(gate|up)={remote.buffer_type().name};attn_k={remote.name.lower()}".split(";")
    with load_model(path, rpc=[rpc_server], n_gpu_layers=0, tensor_overrides=spec, devices="cpu") as model:
        n = model.config.n_layer
        assert all(d.type == "CPU" for d in model.placement.layers) and remote in model.placement.devices()
        assert all(f"blk.{i}.attn_qkv.weight" not in model.fused for i in range(n))
        want = {f"blk.{i}.{w}.weight" for i in range(n) for w in ("ffn_gate_up", "attn_k")}
        assert model.weights.overridden == dict.fromkeys(want, remote.name)
        assert model.fused[f"blk.{n - 1}.ffn_gate_up.weight"] == (f"blk.{n - 1}.ffn_gate.weight",
                                                                  f"blk.{n - 1}.ffn_up.weight")
        for name, (t, _) in model.weights.tensors.items():
            assert t.is_host == (name not in want), name
        assert set(model.report.devices[remote.name].weights) == set(range(n))
        with Runner(model, n_ctx=64, type_k="f32", type_v="f32") as rt:
            got = np.concatenate([rt.decode(PROMPT, logits="all"), rt.decode([23]), rt.decode([311])])
            assert rt.rt.stats["tg"][1] > 1           # a real cross-device graph: split per device change
        _close(got, ref)


@pytest.mark.rpc
def test_bench_sweeps_overrides_and_n_cpu_moe(arch_files, rpc_server, capsys):  # noqa: F811
    """``ggmlpy bench -ot A,B -ncmoe 0,1`` as llama-bench: one configuration per value (the model loaded
    anew for each), the values in the records and in the markdown table's ``n_cpu_moe`` and ``ot``
    columns; a device nobody has is refused with the reason, the run going on with the others."""
    import json

    from ggmlpy import cli

    remote = _server(rpc_server)
    argv = ["bench", "-m", str(arch_files("qwen3moe")), "-rpc", rpc_server, "-ngl", "99", "-p", "8", "-n", "0",
            "-r", "1", "--no-warmup", "-ncmoe", "0,1", "-ot", f"attn_q=CPU;ffn_gate_inp={remote.name},none"]
    assert cli.main([*argv, "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["n_cpu_moe"], r["tensor_buft_overrides"], r["backends"]) for r in rows] == \
        [(n, ot, "RPC") for n in (0, 1) for ot in (f"attn_q=CPU;ffn_gate_inp={remote.name}", "none")]
    assert all(r["avg_ts"] > 0 for r in rows)
    assert cli.main([*argv, "-ot", "x=GPU9"]) != 0
    out, err = capsys.readouterr()
    header = next(line for line in out.splitlines() if "test" in line).split("|")
    assert [h.strip() for h in header if h.strip() in ("n_cpu_moe", "ot")] == ["n_cpu_moe", "ot"]
    assert "unknown device or buffer type 'GPU9'" in err
