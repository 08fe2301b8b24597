"""What the benchmark loop needs from an inference engine (:class:`Engine`), and the loop: :func:`run_instance`
times one test on any engine the way llama-bench does.

Image tests (``-i``) time the vision encoder: a random RGB image of the encoder's native size (the same
pixels for every engine, from the test's seed) is preprocessed once, untimed (resize, and tiles for
idefics3: :meth:`Engine.prepare_images`); one image is encoded untimed as the warm-up; each repetition then
encodes ``n_images`` of it, one image at a time as a prompt's images are (:meth:`Engine.encode_images`:
setting the pixels, computing the encoder graph, reading its output), as llama.cpp's ``mtmd`` reports its
encode time.

Both processes of ``--vs`` run this loop, ggmlpy's engine
(:mod:`.ggmlpy_engine`) in the driver and llama.cpp's (:mod:`.llamacpp`) in the
worker, so this module imports nothing from ggmlpy.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from .errors import BenchError
from .results import Instance, Result

__all__ = ["Engine", "Progress", "run_instance"]


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Engine:
    """What the benchmark loop needs from an inference engine.

    An engine holds at most one model and one context; :func:`run_instance`
    drives it. Subclasses: :class:`GgmlpyEngine` and :class:`LlamaCppEngine`.
    """

    name = "engine"
    version = ""

    def __init__(self) -> None:
        self.model_key: tuple | None = None
        self.load_time_ms = 0.0
        self.info: dict[str, Any] = {}

    def system(self) -> dict[str, Any]:
        """build_commit, build_number, cpu_info, gpu_info."""
        raise NotImplementedError

    def load(self, inst: Instance) -> None:
        """Load ``inst.model`` (placed per ``inst``, read per ``inst.load_mode``), setting :attr:`info`
        (desc, size, n_params, n_vocab, backends)."""
        raise NotImplementedError

    def unload(self) -> None:
        """Free the model."""

    def new_context(self, inst: Instance) -> None:
        """Create the context (KV cache, compute buffers) of a test; with ``inst.embeddings``, later
        decodes output every token's embedding."""
        raise NotImplementedError

    def free_context(self) -> None:
        """Free the context."""

    def clear(self) -> None:
        """Empty the KV cache."""
        raise NotImplementedError

    def decode(self, tokens: np.ndarray) -> None:
        """Append ``tokens`` to the sequence and compute, synchronously."""
        raise NotImplementedError

    def memory_report(self) -> str | None:
        """The memory report of the current context, if the engine has one."""
        return None

    def prepare_images(self, inst: Instance, image: np.ndarray) -> tuple[int, int]:
        """Preprocess ``image`` (uint8 ``(S, S, 3)``) for an image test's context, untimed: afterwards
        :meth:`encode_images` encodes it. Returns the tiles the engine cut it into and the embedding rows one
        image gives the text model."""
        raise NotImplementedError(f"{self.name} has no image tests")

    def encode_images(self, n: int) -> None:
        """Encode the prepared image ``n`` times, one image at a time, synchronously, reading every output."""
        raise NotImplementedError(f"{self.name} has no image tests")

    def ensure_model(self, inst: Instance) -> None:
        """Load the model unless the loaded one has the same file and placement."""
        if self.model_key == inst.model_key():
            return
        if self.model_key is not None:
            self.unload()
            self.model_key = None
        t0 = time.perf_counter()
        self.load(inst)
        self.load_time_ms = (time.perf_counter() - t0) * 1e3
        self.model_key = inst.model_key()

    def close(self) -> None:
        """Free everything."""
        self.free_context()
        if self.model_key is not None:
            self.unload()
            self.model_key = None


Progress = Callable[[str], None]


def run_instance(engine: Engine, inst: Instance, reps: int, seed: int, index: int = 0,
                 warmup: bool = True, delay: float = 0.0, progress: Progress | None = None,
                 verbose: Callable[[str], None] | None = None, image_size: int | None = None) -> Result:
    """Run one test on ``engine`` the way llama-bench does and return its measurements.

    Parameters
    ----------
    engine : Engine
    inst : Instance
    reps : int
        Timed repetitions.
    seed, index : int
        The random token ids (image tests: the image's pixels) come from
        ``numpy.random.default_rng([seed, index])``, so two engines given the same pair see the same ids.
    warmup : bool
        One untimed prompt (if any) and one generated token (if any) first; image tests: one image.
    delay : float
        Seconds of sleep before the test.
    progress : callable, optional
        Called with llama-bench's progress messages (``"prompt run 1/5"``).
    verbose : callable, optional
        Called with the engine's memory report once the context exists.
    image_size : int, optional
        Image tests: the side of the square image, in pixels (the encoder's native size, which the driver
        reads from the mmproj file); default ``engine.info["image_size"]``.
    """
    say = progress or (lambda msg: None)
    engine.ensure_model(inst)
    engine.new_context(inst)
    try:
        if verbose is not None:
            rep = engine.memory_report()
            if rep:
                verbose(rep)
        info = engine.info
        n_vocab = info["n_vocab"]
        rng = np.random.default_rng([int(seed), int(index)])
        if inst.n_images > 0:
            return _run_images(engine, inst, reps, rng, warmup, delay, say, image_size)

        def prompt(n: int) -> None:
            done = 0
            while done < n:
                k = min(n - done, inst.n_batch)
                engine.decode(rng.integers(0, n_vocab, size=k, dtype=np.int32))
                done += k

        def gen(n: int) -> None:
            tok = np.empty(1, dtype=np.int32)
            tok[0] = rng.integers(0, n_vocab)
            for _ in range(n):
                engine.decode(tok)
                tok = np.array([rng.integers(0, n_vocab)], dtype=np.int32)

        engine.clear()
        if delay > 0:
            time.sleep(delay)
        if warmup:
            if inst.n_prompt > 0:
                say("warmup prompt run")
                prompt(inst.n_prompt)
            if inst.n_gen > 0:
                say("warmup generation run")
                gen(1)
        samples, ttfts = [], []
        for r in range(reps):
            engine.clear()
            if inst.n_depth > 0:
                say(f"depth run {r + 1}/{reps}")
                prompt(inst.n_depth)
            t0 = time.perf_counter_ns()
            ttft = None
            if inst.n_prompt > 0:
                say(f"prompt run {r + 1}/{reps}")
                prompt(inst.n_prompt)
                ttft = time.perf_counter_ns() - t0
            if inst.n_gen > 0:
                say(f"generation run {r + 1}/{reps}")
                if ttft is None:
                    gen(1)
                    ttft = time.perf_counter_ns() - t0
                    gen(inst.n_gen - 1)
                else:
                    gen(inst.n_gen)
            samples.append(max(1, time.perf_counter_ns() - t0))
            ttfts.append(ttft or 0)
        return _result(engine, inst, samples, ttfts)
    finally:
        engine.free_context()


def _result(engine: Engine, inst: Instance, samples: list[int], ttfts: list[int], **image: int) -> Result:
    sysinfo, info = engine.system(), engine.info
    return Result(
        inst=inst, engine=engine.name, engine_version=engine.version,
        build_commit=sysinfo["build_commit"], build_number=sysinfo["build_number"],
        cpu_info=sysinfo["cpu_info"], gpu_info=sysinfo["gpu_info"], backends=info["backends"],
        model_type=info["desc"], model_size=info["size"], model_n_params=info["n_params"],
        load_mode=inst.load_mode, test_time=_utc_now(), samples_ns=samples, ttft_ns=ttfts,
        load_time_ms=engine.load_time_ms, **image)


def _run_images(engine: Engine, inst: Instance, reps: int, rng: np.random.Generator, warmup: bool, delay: float,
                say: Progress, image_size: int | None) -> Result:
    """An image test (``-i``), once the context exists: see the module docstring. ``ttft_ns`` is 0 (no token)."""
    side = int(image_size or engine.info.get("image_size") or 0)
    if side < 1:
        raise BenchError(f"{inst.name}: the encoder's image size is unknown (no mmproj loaded?)")
    image = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    tiles, rows = engine.prepare_images(inst, image)
    if delay > 0:
        time.sleep(delay)
    if warmup:
        say("warmup image run")
        engine.encode_images(1)
    samples = []
    for r in range(reps):
        say(f"image run {r + 1}/{reps}")
        t0 = time.perf_counter_ns()
        engine.encode_images(inst.n_images)
        samples.append(max(1, time.perf_counter_ns() - t0))
    return _result(engine, inst, samples, [0] * len(samples), image_size=side, image_tiles=int(tiles),
                   image_tokens=int(rows))
