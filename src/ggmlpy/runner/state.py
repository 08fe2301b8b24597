"""A sequence's saved state, from the runner's side: what its meta holds, and the checks made before one is
loaded (:meth:`Runner.save_state <ggmlpy.runner.Runner.save_state>`, :meth:`~ggmlpy.runner.Runner.load_state`).

The file format, its checksum and the cache's own configuration are :mod:`ggmlpy.kvcache.state`'s; the
meta a runner adds is the model's fingerprint and the tokens the sequence holds, which the slot table
writes and takes back (:meth:`~ggmlpy.runner.slots.SlotTable.save`, :meth:`~ggmlpy.runner.slots.SlotTable.restore`).
"""

from __future__ import annotations

from ggmlpy.kvcache import Recurrent, StateError

from .images import FIRST_IMAGE_ID

__all__ = ["check_state", "fingerprint"]


def fingerprint(model) -> dict:
    """What a saved state must match to be loaded into a runner of ``model``: the model's shape and its
    weights' fingerprint (:mod:`ggmlpy.models.fingerprint`; None for a model without a file)."""
    from ggmlpy.models.fingerprint import model_fingerprint

    m, c = model, model.config
    return {"arch": c.arch, "desc": m.desc, "n_params": int(m.n_params), "size": int(m.size),
            "n_vocab": int(m.n_vocab), "n_layer": int(c.n_layer), "n_embd": int(c.n_embd),
            "weights": model_fingerprint(m)}


def check_state(meta: dict, positions: list, model, cache, n_ctx: int) -> list:
    """The token record of a state's ``meta``, validated against a runner of ``model`` over ``cache`` with
    context ``n_ctx``: the model fingerprint, every token an id of the vocabulary (or an image row: then
    the record is dropped, image ids being the saving runner's own), one token per position, positions
    within the context. Raises StateError naming what is wrong."""
    if set(meta) != {"model", "tokens"}:
        raise StateError(f"load_state: the state's meta has keys {repr(sorted(meta))[:100]}, not 'model' and "
                         "'tokens' (not saved by Runner.save_state)")
    mine, theirs = fingerprint(model), meta["model"]
    if not isinstance(theirs, dict):
        raise StateError("load_state: the state's model fingerprint is not an object")
    if "weights" not in theirs and set(theirs) == set(mine) - {"weights"}:
        raise StateError("load_state: the state was saved by an older ggmlpy, without a weights "
                         "fingerprint: it cannot be checked against this model's weights; save it again")
    if set(theirs) != set(mine):
        raise StateError(f"load_state: the state's model fingerprint has keys {repr(sorted(theirs))[:150]}, "
                         f"expected {sorted(mine)}")
    diff = [f"{k} {theirs[k]!r} in the file, {mine[k]!r} here" for k in mine
            if k != "weights" and (type(theirs[k]) is not type(mine[k]) or theirs[k] != mine[k])]
    if diff:
        raise StateError(f"load_state: the state was saved for another model: {'; '.join(diff)[:300]}")
    if theirs["weights"] != mine["weights"]:
        got = theirs["weights"]
        raise StateError(f"load_state: the state belongs to another model of the same shape: its weights "
                         f"fingerprint {(got[:16] + '...') if isinstance(got, str) else repr(got)[:20]} is "
                         f"not this model's {str(mine['weights'])[:16]}...")
    tokens = meta["tokens"]
    if not isinstance(tokens, list):
        raise StateError(f"load_state: the state's tokens must be a list, not {type(tokens).__name__}")
    n_vocab = int(model.n_vocab)
    images = False
    for i, t in enumerate(tokens):
        if type(t) is not int or not (0 <= t < n_vocab or -2**31 <= t <= FIRST_IMAGE_ID):
            raise StateError(f"load_state: the state's token {i} is {repr(t)[:40]}, not a token id of this "
                             f"model's vocabulary [0, {n_vocab})")
        images |= t < 0
    if images and getattr(model, "POS_PER_TOKEN", 1) != 1:
        raise StateError(f"load_state: the state holds image rows, and a {model.config.arch} model's positions "
                         "after an image follow its grid, which the state does not carry")
    last = max((int(p[-1]) for p in positions if p.size), default=-1)
    if last >= n_ctx:
        raise StateError(f"load_state: the state holds position {last}, beyond this runner's context "
                         f"(n_ctx {n_ctx})")
    if tokens and len(tokens) != last + 1:
        raise StateError(f"load_state: the state lists {len(tokens)} tokens for positions up to {last}: "
                         f"it must list one per position from 0, or none")
    if tokens:
        # the record says every position 0..last was computed: a cache holds them all, without a gap
        # (a sliding window's, at least those the next token sees)
        for i, (c, p) in enumerate(zip(getattr(cache, "caches", [cache]), positions)):
            if isinstance(c, Recurrent):
                # a recurrent state is one row: the state after the last position, which covers them all
                if p.size != 1 or int(p[0]) != last:
                    raise StateError(f"load_state: the state's cache {i} holds a recurrent state of positions "
                                     f"{p.tolist()[:4]}, not the one after position {last} its {len(tokens)} "
                                     "tokens say")
                continue
            window = getattr(c, "window", None)
            need = 0 if window is None else max(0, last + 1 - window)
            if p.size != last + 1 - int(p[0]) or int(p[0]) > need:    # increasing, ending at last
                raise StateError(f"load_state: the state's cache {i} holds {p.size} positions from "
                                 f"{int(p[0])} to {last}, not every one from {need}, as its "
                                 f"{len(tokens)} tokens say")
    return [] if images else tokens
