# kvplan.pxi: the KV cache's per-batch planning in C loops (ggmlpy.kvcache). A one-token plan is made
# for every generated token, where the dozen numpy calls of the general plan (each slow on the caches
# a forward pass has just cooled) cost more than the rest of the step's Python work; a prompt's mask
# is n_tokens x n_kv, where numpy's broadcasts make several full-size temporaries.

from libc.math cimport INFINITY

cdef uint16_t _F16_ZERO = 0x0000, _F16_NEG_INF = 0xFC00


cdef object _mask_array(Py_ssize_t n, Py_ssize_t width, bint half):
    return np.empty((n, width), dtype=np.float16 if half else np.float32)


def _kv_mask(seq_arr, pos_arr, positions_arr, seq_ids_arr, Py_ssize_t lo, Py_ssize_t hi, int64_t window,
             bint causal, except_arr, bint half):
    """The attention mask of a batch over cells ``[lo, hi)``: ``(n, hi - lo)``, 0 visible, -inf hidden.

    ``seq_arr``: uint8 ``[n_cells, n_seq]`` membership; ``pos_arr``: int32 ``[n_cells]``;
    ``positions_arr``/``seq_ids_arr``: int64 ``[n]``; ``except_arr``: uint8 ``[n]`` rows exempt from the
    causal rule, or None; ``window`` < 0: none. Entry ``[i, j]`` is visible when cell ``lo + j`` holds
    ``seq_ids[i]``, its position is ``<= positions[i]`` (unless not ``causal`` or row ``i`` is exempt) and
    ``>= positions[i] - window``. float16 when ``half`` (what the graph reads; 0 and -inf are exact), else
    float32.
    """
    cdef const uint8_t[:, :] seq = seq_arr
    cdef const int32_t[:] pos = pos_arr
    cdef const int64_t[:] positions = positions_arr
    cdef const int64_t[:] seq_ids = seq_ids_arr
    cdef const uint8_t[:] exempt
    cdef Py_ssize_t n = positions.shape[0], n_cells = pos.shape[0], n_seq = seq.shape[1], i, c
    cdef int64_t p, cp, floor, s
    cdef bint free_rows = except_arr is not None, vis
    cdef float[:, ::1] m32
    cdef uint16_t[:, ::1] m16
    if seq.shape[0] != n_cells or seq_ids.shape[0] != n or not 0 <= lo <= hi <= n_cells:
        raise GGMLValueError(f"_kv_mask: cells {n_cells}, seq rows {seq.shape[0]}, {n} positions, "
                             f"{seq_ids.shape[0]} sequence ids, range [{lo}, {hi})")
    if free_rows:
        exempt = except_arr
        if exempt.shape[0] != n:
            raise GGMLValueError(f"_kv_mask: {exempt.shape[0]} exemption flags for {n} rows")
    for i in range(n):
        if not 0 <= seq_ids[i] < n_seq:
            raise GGMLValueError(f"_kv_mask: sequence id {seq_ids[i]} out of range [0, {n_seq})")
    out = _mask_array(n, hi - lo, half)
    if half:
        m16 = out.view(np.uint16)
    else:
        m32 = out
    for i in range(n):
        p = positions[i]
        s = seq_ids[i]
        floor = p - window if window >= 0 else INT64_MIN
        for c in range(lo, hi):
            cp = pos[c]
            vis = seq[c, s] and cp >= floor and (cp <= p or not causal or (free_rows and exempt[i]))
            if half:
                m16[i, c - lo] = _F16_ZERO if vis else _F16_NEG_INF
            else:
                m32[i, c - lo] = 0.0 if vis else -INFINITY
    return out


def _kv_plan_one(occ_arr, seq_arr, pos_arr, Py_ssize_t s, int64_t p, Py_ssize_t pad, int64_t window):
    """``(cell, lo, hi, mask)`` for one token of sequence ``s`` at position ``p`` given the cells' uint8
    ``occ[n_cells]`` (referenced by any sequence), uint8 ``seq[n_cells, n_seq]`` and int32 ``pos[n_cells]``.

    ``cell``: the first free cell (``occ[c] == 0``), -1 when there is none
    (then ``mask`` is None). ``[lo, hi)``: the range covering the sequence's
    cells and ``cell``, ``lo`` rounded down and ``hi`` up to ``pad`` (``hi``
    at most the cell count). ``mask``: float16 ``(1, hi - lo)``, 0 where the
    token sees the cell (``cell`` itself, or a cell of ``s`` with a position
    ``<= p`` and ``>= p - window``), else -inf; ``window`` < 0 means none.
    The same plan as ``Cells`` gives after ``apply``, ``visible_range`` and
    ``mask``.
    """
    cdef const uint8_t[:] occ = occ_arr
    cdef const uint8_t[:, :] seq = seq_arr
    cdef const int32_t[:] pos = pos_arr
    cdef Py_ssize_t n = occ.shape[0], c, cell = -1, first = -1, last = -1, lo, hi
    cdef int64_t cp, floor = INT64_MIN
    cdef uint16_t[:, ::1] mv
    if seq.shape[0] != n or pos.shape[0] != n or not 0 <= s < seq.shape[1]:
        raise GGMLValueError(f"_kv_plan_one: cells {n}, seq ({seq.shape[0]}, {seq.shape[1]}), pos {pos.shape[0]}, "
                             f"sequence {s}: expected one row per cell and a sequence column")
    if pad < 1 or p < 0:
        raise GGMLValueError(f"_kv_plan_one: pad {pad} must be >= 1 and position {p} >= 0")
    for c in range(n):
        if not occ[c]:
            cell = c
            break
    if cell < 0:
        return -1, 0, 0, None
    for c in range(n):
        if seq[c, s]:
            first = c
            break
    for c in range(n - 1, -1, -1):
        if seq[c, s]:
            last = c
            break
    if first < 0 or cell < first:
        first = cell
    if last < cell:
        last = cell
    lo = first // pad * pad
    hi = min((last + pad) // pad * pad, n)
    if window >= 0:
        floor = p - window
    mask = _mask_array(1, hi - lo, True)
    mv = mask.view(np.uint16)
    for c in range(lo, hi):
        cp = pos[c]
        mv[0, c - lo] = _F16_ZERO if c == cell or (seq[c, s] and floor <= cp <= p) else _F16_NEG_INF
    return cell, lo, hi, mask
