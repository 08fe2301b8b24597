"""What ``ggmlpy bench`` prints: llama-bench's md table, CSV, JSON, JSONL and SQL (:func:`make_printer`,
:func:`format_results`), and the ``--plot`` PNG (:func:`plot`).

Every format has llama-bench's fields (:data:`FIELDS`) with its types and
spellings, so its tools read ours; CSV, JSON and JSONL add ours
(:data:`EXTRA_FIELDS`, and a ``ratio_vs_<peer>`` per ``--vs`` peer) after them.
With ``--roofline``, every format (SQL too) ends with :data:`ROOFLINE_FIELDS`,
the table with four columns (``GB/s``, ``% bw``, ``GFLOP/s``, ``% peak``) and a
footnote giving the machine's measured bounds; without it the output is
llama-bench's. With image tests (``-i``), every format but the table ends with
:data:`IMAGE_FIELDS` (after the roofline's); the table shows them as tests named
``imgN`` whose t/s counts image embedding rows.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any, TextIO

from .errors import BenchError
from .options import PROG, BenchParams
from .results import AUTO_NGL, Instance, Result, _ratio_key
from .roofline import FIELDS as ROOFLINE_FIELDS

__all__ = ["BOOL_FIELDS", "EXTRA_FIELDS", "FIELDS", "FLOAT_FIELDS", "IMAGE_FIELDS", "INT_FIELDS", "ROOFLINE_FIELDS",
           "CsvPrinter", "JsonPrinter", "JsonlPrinter", "MarkdownPrinter", "Printer", "SqlPrinter", "check_plot",
           "format_results", "make_printer", "plot", "swept_variable"]

#: llama-bench's CSV/JSON field list (source @ 0104b151, with the ``repack`` of the llama.cpp in
#: llama-cpp-python 0.3.36, the peer of ``--vs``), in order.
FIELDS = (
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends",
    "model_filename", "model_type", "model_size", "model_n_params", "n_batch",
    "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
    "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode",
    "main_gpu", "no_kv_offload", "flash_attn", "devices", "tensor_split",
    "tensor_buft_overrides", "load_mode", "embeddings",
    "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx",
    "n_prompt", "n_gen", "n_depth",
    "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
)
INT_FIELDS = frozenset((
    "build_number", "n_batch", "n_ubatch", "n_threads", "poll", "model_size", "model_n_params",
    "n_gpu_layers", "main_gpu", "n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns",
    "no_op_offload", "n_cpu_moe", "fit_target", "fit_min_ctx", "flash_attn",
))
BOOL_FIELDS = frozenset(("no_kv_offload", "cpu_strict", "embeddings", "no_host", "repack"))
FLOAT_FIELDS = frozenset(("avg_ts", "stddev_ts"))

#: Our fields, written after llama-bench's (and after the samples in JSON).
EXTRA_FIELDS = ("engine", "engine_version", "ggmlpy_version", "load_time_ms", "ttft_ms")
#: The image tests' fields (``-i``), written last, only when ``-i`` is given: images per repetition, the mmproj
#: file, the image's side in pixels, the tiles the engine cut it into and its embedding rows per image (0 and ""
#: on the token tests of the run).
IMAGE_FIELDS = ("n_images", "mmproj", "image_size", "image_tiles", "image_tokens")
_IMAGE_INTS = frozenset(("n_images", "image_size", "image_tiles", "image_tokens"))
#: The ``--roofline`` fields that are integers (the others are floats); all may be null.
_ROOFLINE_INTS = frozenset(("roofline_weight_bytes", "roofline_kv_bytes", "roofline_flops"))
#: The table's ``--roofline`` columns: field, heading, width, format.
_ROOFLINE_MD = (("roofline_gbps", "GB/s", 9, "{:.2f}"), ("roofline_bw_pct", "% bw", 6, "{:.1f}"),
                ("roofline_gflops", "GFLOP/s", 9, "{:.1f}"), ("roofline_peak_pct", "% peak", 6, "{:.1f}"))
_ROOFLINE_NOTE = ("GB/s: t/s x the weight and KV-cache bytes read per generated token; GFLOP/s: t/s x the prompt's "
                  "FLOPs per token; % of the bounds above (pp+tg: each phase's work over the whole time). "
                  "See ggmlpy.benchmark.roofline.")


def _roofline(r: Result) -> dict[str, Any]:
    return r.roofline or dict.fromkeys(ROOFLINE_FIELDS)


def _images(params: BenchParams) -> bool:
    """Whether the run has image tests (and its CSV/JSON/SQL the image fields)."""
    return any(n > 0 for n in params.n_images)


# --------------------------------------------------------------------------- printers

def _value_str(name: str, value: Any) -> str:
    """A field as llama-bench's C++ ``std::to_string`` writes it (CSV/SQL)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return ""
    if name in FLOAT_FIELDS or isinstance(value, float):
        return f"{value:f}"
    return str(value)


def _md_width(name: str) -> int:
    widths = {"model": -30, "t/s": 20, "size": 10, "params": 10, "n_gpu_layers": 4,
              "n_threads": 7, "n_batch": 7, "n_ubatch": 8, "type_k": 6, "type_v": 6,
              "flash_attn": 3, "devices": -12, "load_mode": 10, "test": 15,
              **{f: w for f, _, w, _ in _ROOFLINE_MD}}
    if name in widths:
        return widths[name]
    w = max(len(name), 10)
    # llama-bench left-aligns only its string fields
    numeric = name in INT_FIELDS or name in FLOAT_FIELDS or name in BOOL_FIELDS or name.startswith("ratio")
    return w if numeric else -w


_MD_DISPLAY = {"n_gpu_layers": "ngl", "n_threads": "threads", "flash_attn": "fa", "devices": "dev",
               "no_kv_offload": "nkvo", "no_op_offload": "nopo",
               "split_mode": "sm", "main_gpu": "mg", "tensor_split": "ts", "load_mode": "lm", "embeddings": "embd",
               "tensor_buft_overrides": "ot",
               **{f: h for f, h, _, _ in _ROOFLINE_MD}}


def _size_str(n: int) -> str:
    return f"{n / 1024 / 1024:.2f} MiB" if n < 1024 ** 3 else f"{n / 1024 ** 3:.2f} GiB"


def _params_str(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


def _model_str(r: Result) -> str:
    """The table's model column: the engine's description, where llama.cpp's has no size for a shape its
    loader does not know (``llama ?B F16``) the parameter count it reported written in, as ggmlpy's
    (``llama 134M F16``), so that both engines' rows name the model alike. (The CSV, JSON and SQL keep each
    engine's own ``model_type``.)"""
    from ggmlpy.models.synthetic import _count_label

    parts = r.model_type.split(" ")
    if len(parts) >= 3 and parts[1] == "?B" and r.model_n_params > 0:
        parts[1] = _count_label(r.model_n_params)
    return " ".join(parts)


class Printer:
    """Writes results as they come: a header, one row per test, a footer."""

    def __init__(self, out: TextIO, params: BenchParams, gpu: bool, build: str):
        self.out, self.params, self.gpu, self.build = out, params, gpu, build
        #: Lines the table's footer adds after the build line (``--roofline``: the machine's bounds).
        self.notes: list[str] = []
        #: The own kernels each model's runners took (the engine's ``kernel_notes``), after the notes.
        self.kernel_notes: list[str] = []
        #: Notes on the results (rows too noisy to trust), the table's last lines.
        self.footnotes: list[str] = []

    #: Whether :meth:`footer` writes :attr:`footnotes` (the table does; the machine formats do not, and
    #: the driver prints them on stderr instead).
    shows_footnotes = False

    def header(self) -> None:
        pass

    def rows(self, results: list[Result]) -> None:
        raise NotImplementedError

    def footer(self) -> None:
        pass

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


class MarkdownPrinter(Printer):
    """llama-bench's table: fixed columns, then the parameters that were given, then test and t/s."""

    shows_footnotes = True

    def header(self) -> None:
        p, d = self.params, BenchParams()
        fields = ["model", "size", "params", "backend"]
        if self.p_vs:
            fields.append("engine")
        if self.gpu or p.n_gpu_layers != d.n_gpu_layers:
            fields.append("n_gpu_layers")
        if len(p.n_threads) > 1 or p.n_threads != d.n_threads or not self.gpu:
            fields.append("n_threads")
        for name in ("n_cpu_moe", "split_mode", "main_gpu", "tensor_split", "tensor_buft_overrides", "n_batch",
                     "n_ubatch", "type_k", "type_v",
                     "no_kv_offload", "no_op_offload", "flash_attn", "devices",
                     "load_mode", "embeddings", "repack"):
            if len(getattr(p, name)) > 1 or getattr(p, name) != getattr(d, name):
                fields.append(name)
        fields += ["test", "t/s"]
        fields += [_ratio_key(peer) for peer in p.vs]
        if p.roofline:
            fields += [f for f, _, _, _ in _ROOFLINE_MD]
        self.fields = fields
        names = [self._display(f) for f in fields]
        self._write("|" + "".join(f" {self._pad(n, _md_width(f))} |" for f, n in zip(fields, names))
                    + "\n")
        self._write("|" + "".join(
            f" {'-' * (abs(_md_width(f)) - 1)}{':' if _md_width(f) > 0 else '-'} |" for f in fields)
            + "\n")

    @property
    def p_vs(self) -> bool:
        return bool(self.params.vs)

    def _display(self, f: str) -> str:
        if f.startswith("ratio_vs_"):
            peer = next(pe for pe in self.params.vs if _ratio_key(pe) == f)
            return f"ggmlpy/{peer}"
        return _MD_DISPLAY.get(f, f)

    @staticmethod
    def _pad(text: str, width: int) -> str:
        return text.ljust(-width) if width < 0 else text.rjust(width)

    def rows(self, results: list[Result]) -> None:
        for r in results:
            rec = r.record()
            cells = []
            for f in self.fields:
                if f == "model":
                    v = _model_str(r)
                elif f == "size":
                    v = _size_str(r.model_size)
                elif f == "params":
                    v = _params_str(r.model_n_params)
                elif f == "backend":
                    v = r.backends
                elif f == "engine":
                    v = r.engine
                elif f == "test":
                    v = r.inst.name
                elif f == "t/s":
                    v = f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}"
                elif f.startswith("ratio_vs_"):
                    peer = next(pe for pe in self.params.vs if _ratio_key(pe) == f)
                    rr = r.ratios.get(peer)
                    v = f"{rr[0]:.2f} ± {rr[1]:.2f}" if rr else ""
                elif f.startswith("roofline_"):
                    x = _roofline(r).get(f)
                    v = "" if x is None else next(fm for n, _, _, fm in _ROOFLINE_MD if n == f).format(x)
                elif f == "n_gpu_layers" and rec[f] == AUTO_NGL:
                    v = "auto"
                else:
                    v = _value_str(f, rec[f])
                cells.append(f" {self._pad(v, _md_width(f))} |")
            self._write("|" + "".join(cells) + "\n")

    def footer(self) -> None:
        self._write(f"\nbuild: {self.build}\n")
        if self.params.roofline:
            self._write("".join(f"{n}\n" for n in [*self.notes, _ROOFLINE_NOTE]))
        self._write("".join(f"{n}\n" for n in self.kernel_notes))
        self._write("".join(f"{n}\n" for n in self.footnotes))


class CsvPrinter(Printer):
    """llama-bench's CSV (every value quoted), our extra fields at the end."""

    def header(self) -> None:
        self.names = list(FIELDS) + list(EXTRA_FIELDS) + [
            k for peer in self.params.vs for k in (_ratio_key(peer), _ratio_key(peer) + "_stddev")]
        if self.params.roofline:
            self.names += ROOFLINE_FIELDS
        if _images(self.params):
            self.names += IMAGE_FIELDS
        self._write(",".join(self.names) + "\n")

    def rows(self, results: list[Result]) -> None:
        for r in results:
            rec = {**r.record(), **r.extras(self.params.vs), **_roofline(r), **r.image_fields()}
            buf = io.StringIO()
            csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n").writerow(
                [_value_str(n, rec[n]) for n in self.names])
            self._write(buf.getvalue())


def _json_record(r: Result, params: BenchParams) -> dict[str, Any]:
    rec = r.record()
    rec["samples_ns"] = list(r.samples_ns)
    rec["samples_ts"] = r.samples_ts
    rec.update(r.extras(params.vs))
    if params.roofline:
        rec.update(_roofline(r))
    if _images(params):
        rec.update(r.image_fields())
    return rec


class JsonPrinter(Printer):
    """A JSON array of test objects (llama-bench's fields, samples, then ours)."""

    def header(self) -> None:
        self.first = True
        self._write("[\n")

    def rows(self, results: list[Result]) -> None:
        for r in results:
            text = json.dumps(_json_record(r, self.params), indent=2)
            text = "\n".join("  " + line for line in text.splitlines())
            self._write(("" if self.first else ",\n") + text)
            self.first = False

    def footer(self) -> None:
        self._write("\n]\n")


class JsonlPrinter(Printer):
    """One JSON object per line."""

    def rows(self, results: list[Result]) -> None:
        for r in results:
            self._write(json.dumps(_json_record(r, self.params)) + "\n")


class SqlPrinter(Printer):
    """llama-bench's SQL: ``CREATE TABLE IF NOT EXISTS llama_bench`` and one INSERT per test."""

    def header(self) -> None:
        def sql_type(f: str) -> str:
            return "REAL" if f in FLOAT_FIELDS else "INTEGER" if (
                f in INT_FIELDS or f in BOOL_FIELDS) else "TEXT"
        cols = [f"  {f} {sql_type(f)}" for f in FIELDS]
        if self.params.roofline:      # (a table made without them needs them added: ALTER TABLE ... ADD COLUMN)
            cols += [f"  {f} {'INTEGER' if f in _ROOFLINE_INTS else 'REAL'}" for f in ROOFLINE_FIELDS]
        if _images(self.params):      # (likewise)
            cols += [f"  {f} {'INTEGER' if f in _IMAGE_INTS else 'TEXT'}" for f in IMAGE_FIELDS]
        cols_text = ",\n".join(cols)
        self._write(f"CREATE TABLE IF NOT EXISTS llama_bench (\n{cols_text}\n);\n\n")

    def rows(self, results: list[Result]) -> None:
        names = (list(FIELDS) + (list(ROOFLINE_FIELDS) if self.params.roofline else [])
                 + (list(IMAGE_FIELDS) if _images(self.params) else []))
        for r in results:
            rec = {**r.record(), **_roofline(r), **r.image_fields()}
            vals = ", ".join("NULL" if f in ROOFLINE_FIELDS and rec[f] is None else
                             "'" + _value_str(f, rec[f]).replace("'", "''") + "'" for f in names)
            self._write(f"INSERT INTO llama_bench ({', '.join(names)}) VALUES ({vals});\n")


_PRINTERS = {"md": MarkdownPrinter, "csv": CsvPrinter, "json": JsonPrinter, "jsonl": JsonlPrinter,
             "sql": SqlPrinter}


def make_printer(fmt: str, out: TextIO, params: BenchParams, gpu: bool = False,
                 build: str = "") -> Printer | None:
    """The printer of format ``fmt`` (None for ``"none"``)."""
    cls = _PRINTERS.get(fmt)
    return cls(out, params, gpu, build) if cls else None


def format_results(results: list[Result], fmt: str = "md", params: BenchParams | None = None,
                   gpu: bool = False, build: str = "") -> str:
    """Results as the text ``ggmlpy bench -o fmt`` prints."""
    buf = io.StringIO()
    pr = make_printer(fmt, buf, params or BenchParams(n_threads=[1]), gpu, build)
    if pr is not None:
        pr.header()
        pr.rows(results)
        pr.footer()
    return buf.getvalue()


# --------------------------------------------------------------------------- plot

def swept_variable(results: list[Result]) -> str | None:
    """The x axis of the plot: ``n_prompt``, ``n_depth`` or ``n_threads``, whichever varies (in that order);
    None when none does (the plot is then a bar per test)."""
    for name in ("n_prompt", "n_depth", "n_threads"):
        if len({getattr(r.inst, name) for r in results if r.inst.n_prompt or name != "n_prompt"}) > 1:
            return name
    return None


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install 'ggmlpy[bench]')") from None
    return plt


def check_plot() -> None:
    """Raise the error :func:`plot` would raise for want of matplotlib, before anything runs."""
    _pyplot()


def plot(results: list[Result], path: str | os.PathLike) -> str:
    """Plot t/s (with the ± as error bars) against the swept variable and save a PNG.

    One line per model file, engine and kind of test (pp, tg, pp+tg). When the prompt
    size is the swept variable, tg tests (which have no prompt) are left out. When
    nothing is swept (one prompt size, depth and thread count), one bar per test,
    grouped by test with a bar per model and engine.

    Returns
    -------
    str
        The x axis: ``"n_prompt"``, ``"n_depth"``, ``"n_threads"``, or ``"test"`` for the bars.

    Raises
    ------
    BenchError
        matplotlib is not installed.
    """
    plt = _pyplot()
    x_name = swept_variable(results)
    if x_name is None:
        _bars(plt, results, path)
        return "test"
    labels = {"n_prompt": "prompt tokens", "n_depth": "depth (tokens in the cache)",
              "n_threads": "threads"}
    lines: dict[tuple, list[tuple[int, float, float]]] = {}
    for r in results:
        i = r.inst
        if x_name == "n_prompt" and i.n_prompt == 0:
            continue
        if x_name == "n_prompt":
            kind = "pp" if i.n_gen == 0 else f"pp+tg{i.n_gen}"
            kind += f" @ d{i.n_depth}" if i.n_depth else ""
        elif x_name == "n_depth":
            kind = Instance(i.model, i.n_prompt, i.n_gen, n_images=i.n_images).name
        else:
            kind = i.name
        key = (Path(i.model).stem, r.engine, kind)  # engines name one model differently
        lines.setdefault(key, []).append((getattr(i, x_name), r.avg_ts, r.stddev_ts))
    fig, ax = plt.subplots(figsize=(8, 5))
    for (model, engine, kind), pts in sorted(lines.items()):
        pts.sort()
        xs, ys, es = zip(*pts)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=f"{model} · {engine} · {kind}")
    ax.set_xlabel(labels[x_name])
    ax.set_ylabel("tokens / s")
    if x_name == "n_prompt" and len({x for pts in lines.values() for x, _, _ in pts}) > 2:
        ax.set_xscale("log", base=2)
    ax.set_title(f"{PROG}: throughput vs {labels[x_name]}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
    return x_name


def _bars(plt, results: list[Result], path: str | os.PathLike) -> None:
    """Nothing swept: a group of bars per test (pp512, tg128, ...), a bar per model and engine in each."""
    tests = list(dict.fromkeys(r.inst.name for r in results))
    series = list(dict.fromkeys((Path(r.inst.model).stem, r.engine) for r in results))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(tests) * max(1, len(series))), 5))
    for k, (model, engine) in enumerate(series):
        got = {r.inst.name: r for r in results if (Path(r.inst.model).stem, r.engine) == (model, engine)}
        xs = [j + (k - (len(series) - 1) / 2) * width for j, t in enumerate(tests) if t in got]
        rs = [got[t] for t in tests if t in got]
        ax.bar(xs, [r.avg_ts for r in rs], width, yerr=[r.stddev_ts for r in rs], capsize=3,
               label=f"{model} · {engine}")
    ax.set_xticks(range(len(tests)))
    ax.set_xticklabels(tests)
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{PROG}: throughput per test (nothing swept)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
