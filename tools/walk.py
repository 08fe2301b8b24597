"""Trace the walk of a token id, or of an image, from ``Runner.submit`` to the graph's input.

Every call and return under ``src/ggmlpy`` whose arguments or return value carry the thing followed
(the token in any container or in a request, prompt or micro-batch; or the image, its message, its
preprocessed form, its pixels, its store entry, its row ids, its embedding rows) is recorded, across the
runner's threads, until ``BuiltGraph.set_inputs`` gives it to the graph. Prints the chain (``*`` marks a
move between files) and the counts::

    python tools/walk.py [--src DIR]                 # a token id through submit (synthetic tiny model)
    python tools/walk.py --image [--chat]            # an image through submit(images=) or submit_chat
                                                     # (a tiny Gemma 3 built by tests/vision_helpers;
                                                     # needs transformers)

``--src`` points at another tree's ``src`` (with its built extension) to compare.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import sys
import tempfile
import threading

import numpy as np

TOKEN = 77


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "..", "src"))
    ap.add_argument("--image", action="store_true", help="follow an image instead of a token id")
    ap.add_argument("--chat", action="store_true", help="with --image: through submit_chat")
    a = ap.parse_args()
    src = os.path.abspath(a.src)
    sys.path.insert(0, src)
    root = os.path.join(src, "ggmlpy") + os.sep
    from ggmlpy.models import load_model
    from ggmlpy.runner import Runner

    tmp = tempfile.mkdtemp(prefix="ggmlpy-walk-")
    if a.image:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        import vision_helpers as vh

        fx = vh.make("gemma3", tmp)
        model = load_model(fx.text_path, mmproj=fx.mmproj_path, devices="cpu")
        runner = Runner(model, n_ctx=256, type_k="f32", type_v="f32", pipeline=False)
        image = vh.sample_image(64, 64, seed=5)
        holds = _image_holds(image)
        template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% for p in m['content'] %}"
                    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
                    "<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Look at "}, {"type": "image", "image": image},
                                             {"type": "text", "text": " please"}]}]
        start = "submit_chat" if a.chat else "submit"
        run = (lambda: runner.submit_chat(msgs, template=template, max_tokens=1, temperature=0).result()) \
            if a.chat else \
            (lambda: runner.submit("Look at <__media__> please", images=[image], max_tokens=1, temperature=0).result())
    else:
        from ggmlpy.models.synthetic import write_synthetic

        model = load_model(write_synthetic(os.path.join(tmp, "tiny.gguf"), "tiny", "F16", seed=3), devices="cpu")
        runner = Runner(model, n_ctx=64, pipeline=False)
        holds, start = _token_holds, "submit"
        run = lambda: runner.submit([1, 2, TOKEN, 5], max_tokens=1, temperature=0).result()   # noqa: E731
    try:
        events = _trace(run, holds, root)
    finally:
        runner.close()
        model.close()
    moves = hops = 0
    started = False
    for kind, frm, to, found in events:
        if not started:
            started = kind == "call" and to[1].endswith("Runner." + start)
            continue
        if frm == to:
            continue                       # a comprehension of the same function
        cross = frm[0] != to[0]
        moves += cross
        hops += 1
        print(f"{'*' if cross else ' '} {kind:4} {frm[0]}:{frm[1]} {'->' if kind == 'call' else '<-'} "
              f"{to[0]}:{to[1]}  [{found}]")
    print(f"from Runner.{start} to the graph's input: {moves} moves between files, {hops} calls and returns "
          f"carrying the {'image' if a.image else 'token'}")


def _trace(run, holds, root: str) -> list:
    events: list = []
    done = threading.Event()

    def where(frame):
        fn = frame.f_code.co_filename
        q = re.sub(r"\.<locals>\.<(listcomp|genexpr|dictcomp|setcomp)>", "", frame.f_code.co_qualname)
        return (fn[len(root):] if fn.startswith(root) else os.path.basename(fn)), q

    def on_return(frame, event, arg):
        if event == "return" and not done.is_set() and arg is not None:
            h = holds(arg)
            if h and frame.f_back is not None:
                events.append(("ret", where(frame), where(frame.f_back), h))
        return on_return

    def tracer(frame, event, arg):
        code = frame.f_code
        if done.is_set() or event != "call" or not code.co_filename.startswith(root):
            return None
        found = []
        for k in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
            if k == "self" or k not in frame.f_locals:
                continue
            v = frame.f_locals[k]
            h = "embedding rows" if k == "embd" and v is not None and code.co_name in ("set_inputs", "set_embd") \
                else holds(v)
            if h:
                found.append(f"{k}={h}")
        if found and frame.f_back is not None:
            events.append(("call", where(frame.f_back), where(frame), ", ".join(found)))
            if code.co_name == "set_inputs" and code.co_filename.endswith(os.path.join("models", "base.py")):
                done.set()
        return on_return

    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return events


def _fields(v, depth, holds):
    if depth <= 2 and (hasattr(v, "__dict__") or hasattr(type(v), "__slots__")) and not isinstance(v, type):
        for name in ("prompt", "ids", "tokens", "pending", "ubatches", "remaining", "tiles"):
            try:
                x = getattr(v, name)
            except Exception:
                continue
            h = holds(x, depth + 1)
            if h:
                return f"{type(v).__name__}.{name}:{h}"
    return None


def _token_holds(v, depth=0):
    """The container holding TOKEN in ``v`` (a name), or None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, np.integer)):
        return type(v).__name__ if int(v) == TOKEN else None
    if isinstance(v, np.ndarray):
        return f"ndarray[{v.dtype}]" if v.dtype.kind in "iu" and v.size and (v == TOKEN).any() else None
    if isinstance(v, (list, tuple, collections.deque)):
        if depth >= 3:
            return None
        for x in list(v)[:4096]:
            h = _token_holds(x, depth + 1)
            if h:
                return type(v).__name__ if h in ("int", "int64", "int32") else f"{type(v).__name__}[{h}]"
        return None
    return _fields(v, depth, _token_holds)


def _image_holds(image):
    pre = importlib.import_module("ggmlpy.vision.preprocess").PreprocessedImage
    entry = importlib.import_module("ggmlpy.runner.images").ImageEntry

    def holds(v, depth=0):
        if v is image:
            return "image"
        if isinstance(v, (pre, entry)):
            return type(v).__name__
        if isinstance(v, np.ndarray):
            if v.dtype == np.float32 and v.ndim == 4 and v.shape[1] == 3:
                return "pixels float32"
            return f"row ids ndarray[{v.dtype}]" if v.dtype.kind in "iu" and v.size and v.min() <= -2 else None
        if isinstance(v, (bool, int, float, str, bytes)) or v is None or depth >= 4:
            return None
        if isinstance(v, dict):
            return next(("message" for x in v.values() if holds(x, depth + 1)), None)
        if isinstance(v, (list, tuple, collections.deque)):
            for x in list(v)[:4096]:
                if type(x) is int and x <= -2:
                    return f"row ids {type(v).__name__}"
                h = holds(x, depth + 1)
                if h:
                    return f"{type(v).__name__}[{h}]"
            return None
        return _fields(v, depth, holds)

    return holds


if __name__ == "__main__":
    main()
