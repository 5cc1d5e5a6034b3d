"""prefill_chunks (runtime/cuda_executor.py), on the CPU: a causal prompt longer than the GPU kernels' rows per
call splits into consecutive chunks of <= limit rows; a mask that cannot be split that way (a tree verify of more
nodes than one call takes, a row seeing a later row) is a CudaRequestError naming the limit."""
import numpy as np
import pytest

from ddtree.errors import InputError
from ddtree.runtime.cuda_executor import CudaRequestError, prefill_chunks
from ddtree.runtime.loop import causal_visible


@pytest.mark.parametrize("T, q, limit, want", [
    (0, 600, 256, [(0, 256), (256, 512), (512, 600)]),
    (7, 256, 256, [(0, 256)]),
    (3, 257, 256, [(0, 256), (256, 257)]),
    (0, 10, 4, [(0, 4), (4, 8), (8, 10)]),
])
def test_a_causal_prompt_splits_into_consecutive_chunks(T, q, limit, want):
    assert prefill_chunks(causal_visible(T, q), T, limit) == want


def test_a_mask_that_cannot_be_chunked_is_a_named_error():
    vis = causal_visible(2, 10)
    tree = vis.copy()
    tree[5, 2 + 3] = False                      # row 5 (second chunk of 4) does not see row 3: a tree, not a prompt
    with pytest.raises(CudaRequestError, match="more than the GPU kernels' 4 per call") as e:
        prefill_chunks(tree, 2, 4)
    assert isinstance(e.value, InputError)      # the CLI reports it in one line (errors.reported)
    ahead = vis.copy()
    ahead[1, 2 + 6] = True                      # row 1 sees row 6, in a later chunk
    with pytest.raises(CudaRequestError, match="rows 0..3"):
        prefill_chunks(ahead, 2, 4)
    assert prefill_chunks(tree, 2, 10) == [(0, 10)]    # one call takes any mask of <= limit rows
