"""The runner's image store: image row ids located in arrays (what M-RoPE positions and the embedding rows read)."""

import numpy as np
import pytest

from ggmlpy import GGMLValueError
from ggmlpy.runner.images import FIRST_IMAGE_ID, ImageStore


def test_index_and_locate_name_each_rows_image():
    store = ImageStore(4)
    with pytest.raises(GGMLValueError, match="not an image row"):
        store.index([FIRST_IMAGE_ID])                       # an empty store knows no row
    assert store.empty
    a = store.add(np.zeros((1, 3, 8, 8), np.float32), 3)
    b = store.add(np.ones((2, 3, 8, 8), np.float32))        # 2 tiles of 4 rows
    assert store.add(np.zeros((1, 3, 8, 8), np.float32), 3) == a and not store.empty
    ids = [b[5], a[0], a[2], b[0], b[7]]
    idx, rows, entries = store.index(ids)
    assert [entries[i] for i in idx] == [entries[1], entries[0], entries[0], entries[1], entries[1]]
    assert rows.tolist() == [5, 0, 2, 0, 7]
    got, rows2 = store.locate(ids)
    assert got == [entries[i] for i in idx] and rows2.tolist() == rows.tolist()
    for bad in (b[-1] - 1, -1):                             # past the last image; a token still being sampled
        with pytest.raises(GGMLValueError, match=f"token id {bad} is not an image row"):
            store.index([a[0], bad])
