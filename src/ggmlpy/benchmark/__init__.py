"""Prompt-processing, token-generation and image-encoding throughput, measured the way llama.cpp's llama-bench
does.

``ggmlpy bench`` (and ``python -m ggmlpy.benchmark``) takes llama-bench's
options with their meanings and defaults, runs the same tests and prints the
same table, CSV, JSON or JSONL, so results can be read by the same tools.

What a test is
--------------
Every test parameter takes comma lists, repeats (``-p 16 -p 32``) and integer
ranges (``a-b``, ``a-b+step``, ``a-b*mult``); all lists are combined as a
cartesian product. For each combination there is one **pp** test per ``-p``
value (process a prompt of that many tokens, in chunks of ``-b``), one **tg**
test per ``-n`` value (generate that many tokens one decode at a time) and one
**pg** test per ``-pg`` pair (both in one timed run). Token ids are random, as
in llama-bench: no tokenizer and no sampling is timed. Each test runs one
untimed warm-up (a full prompt and one generated token), then ``-r``
repetitions; each repetition clears the cache, prefills ``-d`` tokens untimed
and times the prompt and/or generation. The rate of a test is the mean of the
per-repetition rates ``(n_prompt + n_gen) / t`` and its ``±`` the sample
standard deviation of those rates.

Image tests (ours: ``-i N`` with ``--mmproj FILE``, named ``imgN``) time the
model's vision encoder (an mmproj GGUF, loaded with the model). A random RGB
image of the encoder's native size (``clip.vision.image_size``; the same pixels
for every engine) is preprocessed once, untimed (resized, and cut into tiles
for idefics3, as each engine's own preprocessing does); one image is encoded
untimed as the warm-up; each repetition then encodes N images, one at a time
(setting the pixels, computing the encoder graph, reading its output), which
is what llama.cpp's ``mtmd`` reports as its encode time. The rate counts the
embedding rows the text model gets (tiles x tokens per tile per image), so
t/s is image tokens per second. An image test sweeps only what changes the
encoding (the model's placement, ``-fa``, ``-t``) and takes the first value of
every other list; n_prompt and n_gen are 0, so llama-bench's fields read as
an empty test, and ours say what it was (below).

What llama-bench's options mean here
------------------------------------
They drive ggmlpy's runner, so each means what it can mean for it, and a value
that cannot run is refused when the command line is parsed:

* ``-ctk``/``-ctv`` pair freely (ggml's flash attention reads K and V each in
  its own type); without flash attention V is stored transposed, which a
  quantized type cannot be, so a quantized ``-ctv`` with ``-fa off`` is refused
  (:meth:`ggmlpy.runner.Runner.check_cache_types`). A quantized type also needs
  a head size that is a multiple of its block; a model without one fails its
  tests with that message.
* ``-lm none|mmap`` (``-mmp 0|1``, its older spelling; default mmap): the
  loader reads the weights with ``read(2)``, or copies them out of a memory map
  of the file (:class:`ggmlpy.gguf.MappedFile`); either way they end up in
  ggmlpy's own buffers. ``mlock``, ``mmap+mlock`` and ``dio`` are refused.
  Written, as llama-bench writes it, in the ``load_mode`` field.
* ``-nkvo 1``: the K/V cache of every layer stays in host memory whatever
  device computes the layer (``Runner(offload_kqv=False)``); the same as 0 on
  the CPU alone.
* ``-embd 1``: every decode outputs the final-normed hidden state of every
  token (``Runner.decode(embeddings=True)``, the embeddings path) instead of
  the last token's logits. llama.cpp's embeddings mode also outputs every
  token, but computes logits for them too.
* ``--repack 0|1`` (default 1): matrix weights go to the CPU's extra buffer
  types where ggml has kernels for their type and shape (``CPU_REPACK``,
  ``AMX``; ``load_model(repack=...)``), as llama.cpp's loader does; 0 keeps
  every weight in plain memory. Written in the ``repack`` field.

Beyond llama-bench
------------------
* With no ``-m``, a built-in model: a llama GGUF with random weights of the
  size and type chosen by ``--synthetic`` and ``--type`` (comma lists sweep; a
  size that is not built in is refused, with those that are),
  written once to the cache folder (:mod:`ggmlpy.models.synthetic`,
  ``ggmlpy cache``).
* Every list is bounded before it is built (1,024 values, 10,000 tests a run),
  and every value is checked before anything runs, the error naming the flag
  (``-t 0: must be at least 1``) with exit status 2, as in every ``ggmlpy``
  command (:mod:`ggmlpy._cliargs`).
* Extra fields in CSV/JSON/JSONL (after llama-bench's): ``engine``,
  ``engine_version``, ``ggmlpy_version``, ``load_time_ms`` (wall time of
  loading the model the test ran on) and ``ttft_ms`` (time to first token:
  the mean over repetitions of the time from the start of the timed part to the
  end of the decode that produces the first new token's logits, i.e. the whole
  prompt for pp and pp+tg tests and the first one-token decode for tg tests;
  depth prefill is not included, sampling is excluded as everywhere here;
  0 on image tests).
* ``--vs llama.cpp`` runs the same tests, with the same token ids, through
  llama-cpp-python in a separate process (the two packages each ship a
  ``libggml-base.so`` with the same soname, so they must never share a
  process), interleaved test by test with ggmlpy's, and adds the ratio
  ggmlpy/llama.cpp with its spread to each ggmlpy row. The peer gets the same
  options (cache types, flash attention, load mode, KV offload, embeddings,
  repack).
* ``-i N[,N..]`` and ``--mmproj FILE`` (one file for all ``-m`` models, or one
  per model): the image tests above. ggmlpy encodes through a
  :class:`~ggmlpy.runner.Runner`'s scheduler with the test's threads, as the
  runner encodes a prompt's images; llama.cpp through its ``mtmd`` library
  (``llama_cpp.mtmd_cpp``), which is skipped with a "not supported" message
  where llama-cpp-python cannot load it. CSV, JSON, JSONL and SQL then end
  with ``n_images``, ``mmproj``, ``image_size``, ``image_tiles`` (tiles per
  image, as each engine cut it) and ``image_tokens`` (embedding rows per
  image); engines that cut different numbers of tiles are reported on
  stderr, ``-v`` prints the counts.
* ``--rounds N`` runs every test N times, each time ggmlpy and the peers back
  to back (the peers first in every other round); the repetitions of all
  rounds make the row's t/s, and the ratio is the median of the N per-round ratios (``±``: their standard
  deviation), which a burst of other work on a shared machine cannot sway.
* ``--plot FILE.png`` draws t/s against the swept prompt size, depth or thread
  count, one line per model, engine and kind of test, or a bar per test when
  nothing is swept (needs matplotlib, looked for before anything runs).
* Progress is on by default where stderr is a terminal (one line, redrawn;
  ``--no-progress``); ``--progress`` elsewhere prints llama-bench's lines.
* A row whose t/s varies by more than 20% between repetitions gets a footnote
  (the machine was busy: rerun with more ``-r``); in the table's last lines, on
  stderr for the other formats.
* The table's model column writes llama.cpp's ``?B`` (a shape its loader does
  not know) as the parameter count it reported, as ggmlpy's row does.
* ``-v`` prints the memory report (weights, cache, graph per device) of each
  test's configuration.
* ``--roofline`` adds, for every test and engine, the achieved memory
  bandwidth (tg: weight and KV-cache bytes read per generated token × t/s) and
  FLOP rate (pp: the prompt's FLOPs × t/s / n_prompt), and their share of this
  machine's bandwidth and matmul peak, measured once per thread count with
  ggml's own kernels and cached in the cache folder (``--roofline-refresh``
  measures again): four table columns and a footnote, nine fields in the other
  formats (:mod:`~ggmlpy.benchmark.roofline` says what is counted and how).


The package
-----------
One job a module; the names below are re-exported here.

* :mod:`~ggmlpy.benchmark.options`: the command line (:func:`parse_args`,
  :class:`BenchParams`) and the tests it asks for (:func:`make_instances`);
* :mod:`~ggmlpy.benchmark.results`: a test (:class:`Instance`) and what an
  engine measured on it (:class:`Result`), with their ratios;
* :mod:`~ggmlpy.benchmark.engines`: the :class:`Engine` protocol and
  :func:`run_instance`, which times one test on any engine;
* :mod:`~ggmlpy.benchmark.ggmlpy_engine`: :class:`GgmlpyEngine`, the engine
  under test;
* :mod:`~ggmlpy.benchmark.llamacpp`: :class:`LlamaCppEngine`, the ``--vs``
  peer;
* :mod:`~ggmlpy.benchmark.worker`: the peer's process and the JSON lines
  spoken with it (:class:`WorkerClient`);
* :mod:`~ggmlpy.benchmark.output`: the printers (:func:`format_results`) and
  :func:`plot`;
* :mod:`~ggmlpy.benchmark.roofline`: ``--roofline``: the machine's bounds
  (:func:`machine_bounds`) and a test's bytes and FLOPs (:class:`ModelWork`);
* :mod:`~ggmlpy.benchmark.driver`: :func:`run` and :func:`main`;
* :mod:`~ggmlpy.benchmark.errors`: :class:`BenchError`.

The worker process imports engines, errors, llamacpp, results and worker
without ggmlpy (see :mod:`~ggmlpy.benchmark.worker`), so those import nothing
from it.
"""

from __future__ import annotations

from .driver import _debug as _debug
from .driver import _one_line as _one_line
from .driver import _synthetic_models as _synthetic_models
from .driver import main, run
from .engines import Engine, Progress, run_instance
from .errors import BenchError, UnsupportedTest
from .ggmlpy_engine import GgmlpyEngine
from .llamacpp import LlamaCppEngine
from .options import (
    CACHE_TYPES,
    LOAD_MODES,
    OUTPUTS,
    PEERS,
    PROG,
    BenchParams,
    build_parser,
    default_threads,
    make_instances,
    parse_args,
    parse_int_range,
)
from .output import (
    BOOL_FIELDS,
    EXTRA_FIELDS,
    FIELDS,
    FLOAT_FIELDS,
    IMAGE_FIELDS,
    INT_FIELDS,
    ROOFLINE_FIELDS,
    CsvPrinter,
    JsonlPrinter,
    JsonPrinter,
    MarkdownPrinter,
    Printer,
    SqlPrinter,
    check_plot,
    format_results,
    make_printer,
    plot,
    swept_variable,
)
from .results import Instance, Result, ratio, round_ratio
from .roofline import MachineBounds, ModelWork, machine_bounds, roofline_fields
from .worker import PeerUnavailable, PeerUnsupported, WorkerClient

__all__ = [
    "BOOL_FIELDS", "CACHE_TYPES", "EXTRA_FIELDS", "FIELDS", "FLOAT_FIELDS", "IMAGE_FIELDS", "INT_FIELDS",
    "LOAD_MODES", "OUTPUTS", "PEERS", "PROG", "ROOFLINE_FIELDS", "BenchError", "BenchParams", "CsvPrinter", "Engine",
    "GgmlpyEngine", "Instance", "JsonPrinter", "JsonlPrinter", "LlamaCppEngine", "MachineBounds", "MarkdownPrinter",
    "ModelWork", "PeerUnavailable", "PeerUnsupported", "Printer", "Progress", "Result", "SqlPrinter", "UnsupportedTest",
    "WorkerClient", "build_parser", "check_plot", "default_threads", "format_results", "machine_bounds", "main",
    "make_instances",
    "make_printer", "parse_args", "parse_int_range", "plot", "ratio", "round_ratio", "roofline_fields", "run",
    "run_instance", "swept_variable",
]
