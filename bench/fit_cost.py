"""What the placement search costs: time to a decision against the time of one allocation pass.

A synthetic 32-layer llama (F16) and two loopback ``ggmlpy rpc-server --mem`` servers too small for it,
plus the CPU. ``load_model(..., n_gpu_layers="auto")`` tries allocations until the split fits; one
allocation pass is one try on the placement it chose (weights allocated, no data read, the runner's
cache and reserved graphs, everything freed). Reported: the search's time (all its tries, before the
data is read), the median time of one pass, and their ratio (issue 18's target: <= 2x).

    python bench/fit_cost.py [--mem 64,48] [--layers 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from ggmlpy.backend import choose_devices
from ggmlpy.gguf import GGUFReader
from ggmlpy.models import load_model
from ggmlpy.models import synthetic as syn
from ggmlpy.runner.fit import _budgets, _Search, _tensor_bytes

RUNNER = {"n_ctx": 512, "n_batch": 128, "n_ubatch": 128, "type_k": "f16", "type_v": "f16"}


def _opener(path):
    """What load_model gives the fit's search: the model opened on a placement, nothing read."""
    from ggmlpy.load import load_model

    return lambda placement: load_model(path, placement=placement, load=False)


def _server(mem: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ggmlpy.cli", "rpc-server", "--port", str(port), "--threads", "1",
                             "--mem", mem], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise SystemExit("rpc-server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mem", default="64,48", help="the servers' sizes in MiB (default 64,48)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    cfg = syn.SyntheticConfig("fit32", 512, a.layers, 8, 8, 1376, 32000, 4096, "placement search benchmark")
    with tempfile.TemporaryDirectory() as d:
        path = str(syn.write_synthetic(os.path.join(d, "fit32.gguf"), cfg, "F16", seed=0))
        servers = [_server(m) for m in a.mem.split(",")]
        eps = [ep for _, ep in servers]
        try:
            searches, tries, passes = [], [], []
            for _ in range(a.repeats):
                with load_model(path, devices="auto", rpc=eps, n_gpu_layers="auto", margin=0, **RUNNER) as m:
                    fit = m.fit
                    searches.append(fit.seconds)
                    tries.append(len(fit.steps))
                    counts = next(st.counts for st in reversed(fit.steps) if st.ok)
                # one allocation pass on the chosen placement, the same work as one try
                devs = choose_devices("auto", rpc=eps)
                with GGUFReader(path) as r:
                    tb, _ = _tensor_bytes(r, cfg.n_layer)
                s = _Search(path, devs, cfg.n_layer, tb, _budgets(devs, 0, None), _opener(path),
                            {**{k: v for k, v in RUNNER.items() if k != "n_ctx"}, "n_seq_max": 1, "flash_attn": True})
                t0 = time.perf_counter()
                model, step, _ = s.attempt(counts, RUNNER["n_ctx"])
                passes.append(time.perf_counter() - t0)
                if model is not None:
                    model.close()
            print(fit)
            med_s, med_p = statistics.median(searches), statistics.median(passes)
            print(f"\n{cfg.n_layer} layers, servers {a.mem} MiB + CPU, {a.repeats} repeats: search "
                  f"{med_s * 1e3:.1f} ms ({statistics.median(tries):.0f} tries), one allocation pass "
                  f"{med_p * 1e3:.1f} ms: {med_s / med_p:.2f}x")
        finally:
            for p, _ in servers:
                p.kill()


if __name__ == "__main__":
    main()
