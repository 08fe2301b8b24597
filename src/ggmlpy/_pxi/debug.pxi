# debug.pxi: live-object counters. Kept in every build: an integer add per
# create/free costs nothing measurable, and the test suite's leak check needs it.

# indices: 0 Context, 1 Graph, 2 Buffer, 3 Backend, 4 Scheduler
cdef long _live[5]
_live[:] = [0, 0, 0, 0, 0]
_LIVE_NAMES = ("Context", "Graph", "Buffer", "Backend", "Scheduler")


cdef inline void _debug_count(str kind, int delta) noexcept:
    _live[_LIVE_NAMES.index(kind)] += delta


cdef inline void _debug_count_nogil(int which) noexcept nogil:
    _live[which] -= 1


def _live_objects():
    """Counts of live C handles by kind (for leak tests)."""
    return {name: _live[i] for i, name in enumerate(_LIVE_NAMES)}
