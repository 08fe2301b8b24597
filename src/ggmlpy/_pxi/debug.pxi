# debug.pxi: live-object counters. Kept in every build: an integer add per
# create/free costs nothing measurable, and the test suite's leak check needs it.

cdef long _live_contexts = 0
cdef long _live_graphs = 0


cdef inline void _debug_count(str kind, int delta) noexcept:
    global _live_contexts, _live_graphs
    if kind == "Context":
        _live_contexts += delta
    else:
        _live_graphs += delta


cdef inline void _debug_count_nogil(int which) noexcept nogil:
    global _live_contexts, _live_graphs
    if which == 0:
        _live_contexts -= 1
    else:
        _live_graphs -= 1


def _live_objects():
    """Counts of live C handles by kind (for leak tests)."""
    return {"Context": _live_contexts, "Graph": _live_graphs}
