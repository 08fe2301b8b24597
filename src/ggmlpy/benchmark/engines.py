"""What the benchmark loop needs from an inference engine (:class:`Engine`), and the loop: :func:`run_instance`
times one test on any engine the way llama-bench does.

Both processes of ``--vs`` run this loop, ggmlpy's engine
(:mod:`.ggmlpy_engine`) in the driver and llama.cpp's (:mod:`.llamacpp`) in the
worker, so this module imports nothing from ggmlpy.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

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
                 verbose: Callable[[str], None] | None = None) -> Result:
    """Run one test on ``engine`` the way llama-bench does and return its measurements.

    Parameters
    ----------
    engine : Engine
    inst : Instance
    reps : int
        Timed repetitions.
    seed, index : int
        The random token ids come from ``numpy.random.default_rng([seed, index])``,
        so two engines given the same pair see the same ids.
    warmup : bool
        One untimed prompt (if any) and one generated token (if any) first.
    delay : float
        Seconds of sleep before the test.
    progress : callable, optional
        Called with llama-bench's progress messages (``"prompt run 1/5"``).
    verbose : callable, optional
        Called with the engine's memory report once the context exists.
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
        sysinfo = engine.system()
        return Result(
            inst=inst, engine=engine.name, engine_version=engine.version,
            build_commit=sysinfo["build_commit"], build_number=sysinfo["build_number"],
            cpu_info=sysinfo["cpu_info"], gpu_info=sysinfo["gpu_info"], backends=info["backends"],
            model_type=info["desc"], model_size=info["size"], model_n_params=info["n_params"],
            load_mode=inst.load_mode, test_time=_utc_now(), samples_ns=samples, ttft_ns=ttfts,
            load_time_ms=engine.load_time_ms)
    finally:
        engine.free_context()
