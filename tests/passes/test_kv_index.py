"""KV writes that ``analyse_write`` refuses, and forms next to them that it accepts.

The modules only write: ``find`` analyses every write before it looks at any read.
"""

import pytest
import torch

from dcp_compile.passes import GraphPatternError, find
from tests.support import capture_graph
from tests.passes import graphs
from tests.passes.graphs import B, D, HKV, S


class FiveAxisCache(graphs.Projections):
    """A ``[B, H, S, 1, D]`` cache: neither the 4-D nor the 3-D (latent) layout."""

    def __init__(self):
        super().__init__(cache_shape=(B, HKV, S, 1, D))

    def forward(self, x, positions):
        _, k, _ = self.project(x)
        self.k_cache.index_copy_(2, positions, k.transpose(1, 2).unsqueeze(3))


class SequenceFirst(graphs.Projections):
    """A Megatron-style ``[S, B, H, D]`` cache written with ``index_copy_(0, positions, k)``."""

    def __init__(self):
        super().__init__(cache_shape=(S, B, HKV, D))

    def forward(self, x, positions):
        _, k, _ = self.project(x)
        self.k_cache.index_copy_(0, positions, k.transpose(0, 1))


class IndexCopyNegativeDim(graphs.Projections):
    """``index_copy_(-2, positions, k)`` into a ``[B, H, S, D]`` cache: dim -2 is the sequence."""

    def forward(self, x, positions):
        _, k, _ = self.project(x)
        self.k_cache.index_copy_(-2, positions, k.transpose(1, 2))


class Accumulating(graphs.IndexPutBSHD):
    """``index_put_((rows, positions), k, accumulate)`` into a ``[B, S, H, D]`` cache."""

    accumulate = True

    def forward(self, x, positions):
        _, k, _ = self.project(x)
        rows = torch.arange(B)[:, None]
        self.k_cache.index_put_((rows, positions), k, accumulate=self.accumulate)


class Overwriting(Accumulating):
    accumulate = False


class TransposedKeys(graphs.Projections):
    """Keys stored ``[B, H, D, S]`` (head size before sequence), written with ``[..., positions]``."""

    def __init__(self):
        super().__init__(cache_shape=(B, HKV, D, S))

    def forward(self, x, positions):
        _, k, _ = self.project(x)
        self.k_cache[..., positions] = k.permute(0, 2, 3, 1)  # [B, HKV, D, T]


class PerHeadIndex(graphs.Projections):
    """``k_cache[:, heads, positions] = k`` with a tensor over the heads axis."""

    def forward(self, x, positions):
        _, k, _ = self.project(x)
        heads = torch.arange(HKV)[:, None]
        self.k_cache[:, heads, positions] = k.transpose(1, 2)


REFUSED = [
    (FiveAxisCache, r"has shape \(2, 2, 16, 1, 8\); expected a 4-D \[batch, heads, seq, head_dim\]"),
    (SequenceFirst, r"index_copy_ at .* writes along dim 0; expected dim 1 or 2"),
    (Accumulating, r"KV write with accumulate=True at .* is not a cache store"),
    (TransposedKeys, r"indexes the head-size axis; expected a full slice there"),
    (PerHeadIndex, r"indexes cache axes \[1, 2\]; expected one position index on axis 1 or 2"),
]


@pytest.mark.parametrize("module_cls,expected", REFUSED, ids=[cls.__name__ for cls, _ in REFUSED])
def test_write_is_refused(module_cls, expected):
    module = module_cls()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    with pytest.raises(GraphPatternError, match=expected) as error:
        find(gm)
    assert "test_kv_index.py:" in str(error.value), "the error names the user's line"


@pytest.mark.parametrize(
    "module_cls,kind,seq_dim", [(IndexCopyNegativeDim, "index_copy_", 2), (Overwriting, "index_put_", 1)]
)
def test_write_is_accepted(module_cls, kind, seq_dim):
    module = module_cls()
    gm, _ = capture_graph(module, *graphs.inputs_for(module))
    (write,) = find(gm).writes
    assert (write.index.kind, write.cache.seq_dim) == (kind, seq_dim)
