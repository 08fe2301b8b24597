# kvplan.pxi: the KV cache's plan for one more token of one sequence, in C loops. ggmlpy.kvcache makes
# this plan for every generated token, where the dozen numpy calls of the general plan (each slow on
# the caches a forward pass has just cooled) cost more than the rest of the step's Python work.

from libc.math cimport INFINITY


def _kv_plan_one(occ_arr, seq_arr, pos_arr, Py_ssize_t s, int64_t p, Py_ssize_t pad, int64_t window,
                 int64_t chunk):
    """``(slot, lo, hi, mask)`` for one token of sequence ``s`` at position ``p`` given the cells' uint8
    ``occ[n_cells]`` (referenced by any sequence), uint8 ``seq[n_cells, n_seq]`` and int32 ``pos[n_cells]``.

    ``slot``: the first free cell (``occ[c] == 0``), -1 when there is none
    (then ``mask`` is None). ``[lo, hi)``: the range covering the sequence's
    cells and ``slot``, ``lo`` rounded down and ``hi`` up to ``pad`` (``hi``
    at most the cell count). ``mask``: float32 ``(1, hi - lo)``, 0 where the
    token sees the cell (``slot`` itself, or a cell of ``s`` with a position
    ``<= p``, ``>= p - window`` and in ``p``'s chunk), else -inf; ``window``
    or ``chunk`` < 0 means none. The same plan as ``Cells`` gives after
    ``apply``, ``visible_range`` and ``mask``.
    """
    cdef const uint8_t[:] occ = occ_arr
    cdef const uint8_t[:, :] seq = seq_arr
    cdef const int32_t[:] pos = pos_arr
    cdef Py_ssize_t n = occ.shape[0], c, slot = -1, first = -1, last = -1, lo, hi
    cdef int64_t cp, floor_w, floor_c
    cdef float[:, ::1] mv
    if seq.shape[0] != n or pos.shape[0] != n or not 0 <= s < seq.shape[1]:
        raise GGMLValueError(f"_kv_plan_one: cells {n}, seq ({seq.shape[0]}, {seq.shape[1]}), pos {pos.shape[0]}, "
                             f"sequence {s}: expected one row per cell and a sequence column")
    if pad < 1 or p < 0:
        raise GGMLValueError(f"_kv_plan_one: pad {pad} must be >= 1 and position {p} >= 0")
    for c in range(n):
        if not occ[c]:
            slot = c
            break
    if slot < 0:
        return -1, 0, 0, None
    for c in range(n):
        if seq[c, s]:
            first = c
            break
    for c in range(n - 1, -1, -1):
        if seq[c, s]:
            last = c
            break
    if first < 0 or slot < first:
        first = slot
    if last < slot:
        last = slot
    lo = first // pad * pad
    hi = min((last + pad) // pad * pad, n)
    floor_w = p - window if window >= 0 else INT64_MIN
    floor_c = p - p % chunk if chunk > 0 else INT64_MIN
    mask = np.empty((1, hi - lo), dtype=np.float32)
    mv = mask
    for c in range(lo, hi):
        cp = pos[c]
        if c == slot or (seq[c, s] and cp <= p and cp >= floor_w and cp >= floor_c):
            mv[0, c - lo] = 0.0
        else:
            mv[0, c - lo] = -INFINITY
    return slot, lo, hi, mask
