"""The neighbour graph of the Potts prior [1, App. C.1], in CSR form.

* :class:`SpatialGraph` stores both directions of every undirected edge as CSR rows
  ``(indptr, indices, weights)`` and computes neighbour sums ``(W v)_i = sum_j r_ij v_j``
  with a choice of backends (:data:`BACKENDS`): a torch sparse CSR matmul, ``index_add_``,
  or ``torch_scatter.segment_csr`` when torch-scatter is installed (``pip install .[scatter]``).
* :meth:`SpatialGraph.restrict` keeps the edges inside the fixed PD-VI blocks (spatial
  patches, [1, Sec. 5]), as the authors' code does.
* :meth:`SpatialGraph.colour_classes` splits the nodes into independent sets, so that the
  mean-field update of every node in one set is exact coordinate descent done in parallel.

The graph of spots is built by :func:`pyro_pdvi.spatial.knn_graph`.

[1] Lyu, Yu, Ma, Shi (2026), "Scalable Mean-Field Variational Inference via
    Preconditioned Primal-Dual Optimization", arXiv:2602.07632.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: Neighbour-sum backends. ``"auto"`` is ``"sparse"``: on the CPU the torch sparse CSR matmul
#: was the fastest, 11x faster than torch-scatter 2.1.2 at 20k spots and 5x at 150k
#: (docs/benchmarks.md, section 7); ``"scatter"`` is there when asked for.
BACKENDS = ("auto", "sparse", "index_add", "scatter")


def scatter_available() -> bool:
    """Whether the optional torch-scatter backend can be imported."""
    return importlib.util.find_spec("torch_scatter") is not None


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"Invalid backend: {backend!r}; use one of {BACKENDS}")
    if backend == "auto":
        return "sparse"
    if backend == "scatter" and not scatter_available():
        raise ValueError(
            "backend='scatter' needs torch-scatter, which is not installed; "
            "`pip install .[scatter]` (it builds from source) or use backend='sparse'"
        )
    return backend


@dataclass
class SpatialGraph:
    """Weighted graph (or a row slice of one) in compressed sparse row form.

    Row ``i`` lists the neighbours ``indices[indptr[i]:indptr[i+1]]`` of node ``i`` with
    weights ``r_ij``. A full graph is square and symmetric (both directions of each edge
    stored); :meth:`rows` gives a rectangular slice whose columns are still all nodes.

    :param indptr: ``(num_rows + 1,)`` LongTensor of row offsets.
    :param indices: ``(nnz,)`` LongTensor of column indices.
    :param weights: ``(nnz,)`` edge weights ``r_ij``.
    :param num_cols: number of columns (nodes that can be neighbours).
    :param backend: neighbour-sum backend, one of :data:`BACKENDS`.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor
    num_cols: int
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.indptr.dim() != 1 or self.indices.dim() != 1 or self.weights.shape != self.indices.shape:
            raise ValueError(
                "indptr and indices must be 1-D and weights shaped like indices, got "
                f"{tuple(self.indptr.shape)}, {tuple(self.indices.shape)}, {tuple(self.weights.shape)}"
            )
        if int(self.indptr[-1]) != self.indices.numel():
            raise ValueError(
                f"indptr[-1] = {int(self.indptr[-1])} but there are {self.indices.numel()} indices"
            )
        self.backend = _check_backend(self.backend)
        self._row_of_entry: torch.Tensor | None = None
        self._sparse: torch.Tensor | None = None

    # ------------------------------------------------------------------ shape

    @property
    def num_rows(self) -> int:
        """Number of rows."""
        return self.indptr.numel() - 1

    @property
    def num_edges(self) -> int:
        """Undirected edges of a symmetric graph (half the stored entries)."""
        return self.indices.numel() // 2

    @property
    def row_of_entry(self) -> torch.Tensor:
        """The row of every stored entry, ``(nnz,)`` (the COO row index)."""
        if self._row_of_entry is None:
            counts = self.indptr.diff()
            self._row_of_entry = torch.repeat_interleave(
                torch.arange(self.num_rows, device=self.indptr.device), counts
            )
        return self._row_of_entry

    def degrees(self) -> torch.Tensor:
        """Weighted degree ``sum_j r_ij`` of every row."""
        return self.neighbour_sum(
            torch.ones(self.num_cols, 1, dtype=self.weights.dtype, device=self.weights.device)
        )[:, 0]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> SpatialGraph:
        """The same graph on ``device`` with weights of ``dtype``."""
        return SpatialGraph(
            self.indptr.to(device),
            self.indices.to(device),
            self.weights.to(device=device, dtype=dtype),
            self.num_cols,
            self.backend,
        )

    def with_weights(self, weights: torch.Tensor | float) -> SpatialGraph:
        """The same edges with new weights (a scalar or one per stored entry)."""
        weights = torch.as_tensor(weights, dtype=self.weights.dtype, device=self.weights.device)
        return SpatialGraph(
            self.indptr, self.indices, weights.expand_as(self.weights).clone(), self.num_cols, self.backend
        )

    # ------------------------------------------------------------------ neighbour sums

    def neighbour_sum(self, values: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """``(W v)_i = sum_j r_ij v_j`` for every row ``i``.

        :param values: ``(num_cols, K)`` values on the nodes.
        :param backend: override of :attr:`backend`.
        :returns: ``(num_rows, K)``.
        """
        if values.dim() != 2 or values.shape[0] != self.num_cols:
            raise ValueError(f"values must have shape ({self.num_cols}, K), got {tuple(values.shape)}")
        backend = self.backend if backend is None else _check_backend(backend)
        weights = self.weights.to(values.dtype)
        if backend == "sparse":
            return self._sparse_matrix(values.dtype) @ values
        messages = weights[:, None] * values.index_select(0, self.indices)
        if backend == "index_add":
            out = values.new_zeros(self.num_rows, values.shape[1])
            return out.index_add_(0, self.row_of_entry, messages)
        import torch_scatter

        return torch_scatter.segment_csr(messages, self.indptr, reduce="sum")

    def _sparse_matrix(self, dtype: torch.dtype) -> torch.Tensor:
        if self._sparse is None or self._sparse.dtype != dtype:
            with warnings.catch_warnings():  # torch's "beta" notice for sparse CSR
                warnings.simplefilter("ignore", UserWarning)
                self._sparse = torch.sparse_csr_tensor(
                    self.indptr, self.indices, self.weights.to(dtype), size=(self.num_rows, self.num_cols)
                )
        return self._sparse

    # ------------------------------------------------------------------ subgraphs

    def rows(self, nodes: torch.Tensor) -> SpatialGraph:
        """The rows ``nodes`` (all columns kept): ``rows(S).neighbour_sum(v) == neighbour_sum(v)[S]``."""
        nodes = nodes.to(self.indptr.device)
        starts, ends = self.indptr[nodes], self.indptr[nodes + 1]
        counts = ends - starts
        indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        offsets = torch.arange(int(indptr[-1]), device=nodes.device) - torch.repeat_interleave(
            indptr[:-1] - starts, counts
        )
        return SpatialGraph(indptr, self.indices[offsets], self.weights[offsets], self.num_cols, self.backend)

    def subgraph(self, nodes: torch.Tensor) -> SpatialGraph:
        """The induced subgraph on ``nodes`` (distinct), renumbered ``0..len(nodes)-1`` in their order."""
        nodes = nodes.to(self.indptr.device)
        position = torch.full((self.num_cols,), -1, dtype=torch.long, device=nodes.device)
        position[nodes] = torch.arange(nodes.numel(), device=nodes.device)
        sliced = self.rows(nodes)
        local = position[sliced.indices]
        keep = local >= 0
        counts = torch.zeros(nodes.numel(), dtype=torch.long, device=nodes.device).index_add_(
            0, sliced.row_of_entry[keep], torch.ones_like(local[keep])
        )
        indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return SpatialGraph(indptr, local[keep], sliced.weights[keep], nodes.numel(), self.backend)

    def restrict(self, blocks: Sequence[torch.Tensor]) -> SpatialGraph:
        """Only the edges whose two ends lie in the same block (the patches of [1, Sec. 5]).

        :param blocks: 1-D LongTensors partitioning the nodes.
        """
        label = torch.full((self.num_rows,), -1, dtype=torch.long, device=self.indptr.device)
        for b, block in enumerate(blocks):
            label[block.to(label.device)] = b
        if bool((label < 0).any()):
            raise ValueError(f"blocks must cover every node; node {int((label < 0).nonzero()[0])} is in none")
        keep = label[self.row_of_entry] == label[self.indices]
        counts = torch.zeros(self.num_rows, dtype=torch.long, device=label.device).index_add_(
            0, self.row_of_entry[keep], torch.ones_like(self.indices[keep])
        )
        indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return SpatialGraph(indptr, self.indices[keep], self.weights[keep], self.num_cols, self.backend)

    # ------------------------------------------------------------------ colouring

    def colour_classes(self, seed: int = 0, strategy: str = "greedy") -> list[torch.Tensor]:
        """Independent sets that partition the nodes of a square graph (a proper colouring).

        Rounds of the Jones-Plassmann rule [1]: among the uncoloured nodes, those whose random
        priority beats every uncoloured neighbour's are coloured in this round, all at once.
        With ``strategy="greedy"`` each takes the smallest colour that none of its coloured
        neighbours has, so a graph of maximum degree ``D`` needs at most ``D + 1`` colours
        (a mutual 6-NN graph of spots about 5-6); with ``"rounds"`` every round is a new class
        (Luby's rule: a few tens of classes on a kNN graph). Vectorised, ``O(nnz)`` per round.
        Fewer classes are fewer (larger) steps in every sweep of the mean-field solver.

        [1] Jones, Plassmann (1993), "A parallel graph coloring heuristic", SIAM J. Sci. Comput.

        :param seed: seed of the priorities.
        :param strategy: ``"greedy"`` or ``"rounds"`` (see above).
        :returns: sorted LongTensors of node indices, on the graph's device, none empty.
        """
        if strategy not in ("greedy", "rounds"):
            raise ValueError(f"Invalid strategy: {strategy!r}; use 'greedy' or 'rounds'")
        if self.num_rows != self.num_cols:
            raise ValueError("colour_classes needs a square graph (not a row slice)")
        indptr = self.indptr.cpu().numpy()
        indices = self.indices.cpu().numpy()
        rng = np.random.default_rng(seed)
        priority = rng.permutation(self.num_rows).astype(np.float64)
        uncoloured = np.ones(self.num_rows, dtype=bool)
        rows = np.repeat(np.arange(self.num_rows), np.diff(indptr))
        if (rows == indices).any():
            raise ValueError(
                f"the graph has a self-loop at node {int(rows[rows == indices][0])}; a Potts graph has none "
                "(SpatialGraph.from_scipy drops stored zeros: check the matrix's diagonal)"
            )
        nonempty = indptr[:-1] < indptr[1:]
        starts = indptr[:-1][nonempty]
        colour = np.full(self.num_rows, -1, dtype=np.int64)
        num_rounds = 0
        while uncoloured.any():
            neighbour_priority = np.where(uncoloured[indices], priority[indices], -np.inf)
            best = np.full(self.num_rows, -np.inf)
            if indices.size:
                best[nonempty] = np.maximum.reduceat(neighbour_priority, starts)
            chosen = uncoloured & (priority > best)
            if strategy == "rounds":
                colour[chosen] = num_rounds
            else:
                colour[chosen] = _smallest_free_colour(colour, indptr, indices, np.flatnonzero(chosen))
            uncoloured &= ~chosen
            num_rounds += 1
        return [
            torch.from_numpy(np.flatnonzero(colour == c)).to(self.indptr.device)
            for c in range(int(colour.max()) + 1)
            if (colour == c).any()
        ]

    # ------------------------------------------------------------------ conversions

    def to_scipy(self):
        """The graph as a ``scipy.sparse.csr_matrix`` (CPU, float64)."""
        import scipy.sparse

        return scipy.sparse.csr_matrix(
            (
                self.weights.detach().cpu().double().numpy(),
                self.indices.cpu().numpy(),
                self.indptr.cpu().numpy(),
            ),
            shape=(self.num_rows, self.num_cols),
        )

    @classmethod
    def from_scipy(cls, matrix, backend: str = "auto", dtype: torch.dtype | None = None) -> SpatialGraph:
        """A graph from a ``scipy.sparse`` matrix (converted to CSR with sorted indices)."""
        matrix = matrix.tocsr(copy=True)
        matrix.eliminate_zeros()
        matrix.sort_indices()
        dtype = torch.get_default_dtype() if dtype is None else dtype
        return cls(
            torch.from_numpy(matrix.indptr.astype(np.int64)),
            torch.from_numpy(matrix.indices.astype(np.int64)),
            torch.from_numpy(matrix.data.astype(np.float64)).to(dtype),
            matrix.shape[1],
            backend,
        )


def _smallest_free_colour(
    colour: np.ndarray, indptr: np.ndarray, indices: np.ndarray, nodes: np.ndarray
) -> np.ndarray:
    """For each of ``nodes`` (no two adjacent), the smallest colour none of its neighbours has
    (``colour`` is -1 where not yet coloured)."""
    counts = indptr[nodes + 1] - indptr[nodes]
    entries = (
        np.repeat(indptr[nodes], counts)
        + np.arange(counts.sum())
        - np.repeat(np.cumsum(counts) - counts, counts)
    )
    owner = np.repeat(np.arange(nodes.size), counts)
    taken_colour = colour[indices[entries]]
    used = taken_colour >= 0
    width = int(taken_colour.max()) + 2 if taken_colour.size else 1
    taken = np.zeros((nodes.size, width), dtype=bool)
    taken[owner[used], taken_colour[used]] = True
    return np.argmin(taken, axis=1)  # the first False: a free colour always exists in the last column
