import pytest
import torch


from spatial_pipelines.core.tree import chain_tree, tree_from_parents, tree_from_paths
from helpers.walks import RandomSource, residual, verify_tree_sequential

from helpers import chi_square_pvalue


def test_tree_from_paths_structure():
    tree = tree_from_paths([(0, 0), (0, 1), (1,), (2,)])
    # nodes: root, (0), (1), (2), (0,0), (0,1)
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1]
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2]
    assert tree.ranks.tolist() == [-1, 0, 1, 2, 0, 1]
    assert tree.children[0].tolist() == [1, 2, 3] and tree.children[1].tolist() == [4, 5, -1]
    assert tree.attention_mask[4].tolist() == [True, True, False, False, True, False]
    assert sorted(map(tuple, tree.retrieve_indices.tolist())) == [(0, 1, 4), (0, 1, 5), (0, 2, -1), (0, 3, -1)]
    assert tree.max_depth == 2 and tree.num_nodes == 6


def test_chain_tree_is_causal():
    tree = chain_tree(3)
    assert torch.equal(tree.attention_mask, torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1]])
def test_tree_from_parents_rejects_bad_orders(parents):
    with pytest.raises(ValueError, match="parents"):
        tree_from_parents(parents)


def _probs(b, t, v, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, v, generator=g).mul(1.5).softmax(-1).expand(b, t, v).clone()


def test_greedy_walk_follows_the_argmax():
    tree = tree_from_paths([(0, 0), (0, 1), (1,)])  # root, a, b, aa, ab
    v = 5
    probs = torch.nn.functional.one_hot(torch.tensor([[2, 3, 0, 4, 1]]), v).float()  # argmax after each node
    tokens = torch.tensor([[9, 1, 2, 3, 3]])  # node a (=1) is wrong, node b (=2) right, then b is a leaf
    acc = verify_tree_sequential(tree, tokens, probs, RandomSource(torch.Generator().manual_seed(0), 1, "cpu"))
    assert acc.path.tolist() == [[0, 2, -1]] and acc.num_accepted.tolist() == [1] and acc.bonus.tolist() == [0]
    tokens = torch.tensor([[9, 2, 1, 3, 4]])  # a right, then aa (=3) right
    acc = verify_tree_sequential(tree, tokens, probs, RandomSource(torch.Generator().manual_seed(0), 1, "cpu"))
    assert acc.path.tolist() == [[0, 1, 3]] and acc.bonus.tolist() == [4] and acc.last_node.tolist() == [3]


N = 40000


@pytest.mark.parametrize("sampled_candidates", [False, True], ids=["point-mass", "known-q"])
def test_first_committed_code_follows_p(sampled_candidates):
    """Exactness of one tree walk: the first committed code (accepted draft or bonus) is distributed as p at the
    root, whatever the candidates. Pearson chi-square, 40,000 rows, fails when p-value < 1e-4."""
    v = 6
    tree = tree_from_paths([(0, 0), (0, 1), (1,), (2, 0)])
    probs = _probs(N, tree.num_nodes, v, seed=1)
    g = torch.Generator().manual_seed(2)
    q = None
    if sampled_candidates:  # candidates drawn from a known proposal q per node
        q = torch.randn(tree.num_nodes, v, generator=g).softmax(-1).expand(N, -1, -1).clone()
        tokens = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(N, -1)
    else:  # fixed, deliberately poor candidates
        tokens = torch.tensor([0, 5, 4, 3, 5, 2, 1])[: tree.num_nodes].expand(N, -1).clone()
    acc = verify_tree_sequential(tree, tokens, probs, RandomSource(torch.Generator().manual_seed(3), N, "cpu"), q)
    first = torch.where(acc.num_accepted > 0, tokens.gather(1, acc.path[:, 1:2].clamp_min(0)).squeeze(1), acc.bonus)
    counts = torch.bincount(first, minlength=v)
    assert chi_square_pvalue(counts, probs[0, 0]) > 1e-4
    # the statistic has power: a biased rule (over-accepting point masses, or the wrong q) is caught
    wrong_q = torch.full_like(probs, 0.5) if q is None else q.roll(1, dims=-1)
    wrong = verify_tree_sequential(tree, tokens, probs, RandomSource(torch.Generator().manual_seed(3), N, "cpu"), wrong_q)
    first_wrong = torch.where(wrong.num_accepted > 0, tokens.gather(1, wrong.path[:, 1:2].clamp_min(0)).squeeze(1), wrong.bonus)
    assert chi_square_pvalue(torch.bincount(first_wrong, minlength=v), probs[0, 0]) < 1e-4


def test_residual():
    p, q = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.6, 0.2]])
    torch.testing.assert_close(residual(p, q), torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.equal(residual(p, p), p)  # nothing left: unchanged (never used by exact acceptance)


# -- one tree per row (EAGLE-2's dynamic trees) ----------------------------------------------------------------
def _random_row_trees(b=5, t=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, t + 1, (b,), generator=g).tolist()
    parents = torch.full((b, t), -1, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    shared = []
    for r, n in enumerate(sizes):
        par = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        parents[r, :n] = torch.tensor(par)
        valid[r, :n] = True
        shared.append(tree_from_parents(par))
    return parents, valid, shared, sizes


def test_row_trees_match_the_static_builder_row_by_row():
    from spatial_pipelines.core.tree import row_trees_from_parents

    parents, valid, shared, sizes = _random_row_trees()
    depth = max(tr.max_depth for tr in shared)
    kids = max(tr.max_children for tr in shared)
    trees = row_trees_from_parents(parents, valid, depth, kids)
    for r, (tr, n) in enumerate(zip(shared, sizes)):
        assert torch.equal(trees.depths[r, :n], tr.depths)
        assert torch.equal(trees.attention_mask[r, :n, :n], tr.attention_mask)
        assert torch.equal(trees.earlier_siblings[r, :n, :n], tr.earlier_siblings)
        assert torch.equal(trees.node_paths[r, :n, : tr.max_depth + 1], tr.node_paths)
        assert (trees.node_paths[r, :n, tr.max_depth + 1 :] == -1).all()
        assert torch.equal(trees.children[r, :n, : tr.max_children], tr.children)
        # padding: invalid, seen by nobody, sees itself only
        seen = trees.attention_mask[r].clone().fill_diagonal_(False)
        assert not trees.valid[r, n:].any() and not seen[:, n:].any() and not seen[n:].any()


class _FixedRandom:
    """Serves the same numbers to a batch and to each of its rows alone, whatever the tree size asks for: node
    uniforms by node, the bonus draw's uniforms, the sequential walk's (depth, sibling) grid, and exponentials."""

    def __init__(self, b, t, v, d, k, seed=0, rows=None):
        g = torch.Generator().manual_seed(seed)
        self.node, self.bonus = torch.rand(b, t - 1, generator=g), torch.rand(b, v, generator=g)
        self.grid, self.exp = torch.rand(b, d, k, generator=g), torch.empty(b, v).exponential_(generator=g)
        self.rows, self.v = (slice(None) if rows is None else rows), v

    def uniform(self, *shape):
        if len(shape) == 1:
            return torch.cat([self.node[self.rows, : shape[0] - self.v], self.bonus[self.rows]], 1)
        return self.grid[self.rows, : shape[0], : shape[1]]

    def exponential(self, *shape):
        return self.exp[self.rows]


@pytest.mark.parametrize("kind", ["point-mass", "relaxed"])
def test_verify_row_trees_equals_verifying_each_row_alone(kind):
    """Per-row trees (padded) verified as one batch commit what each row's own tree commits from the same random
    numbers, on the vectorised walk (point masses) and the sequential one (a relaxed rule)."""
    from spatial_pipelines.core.acceptance import LanternAcceptance, codebook_neighbours
    from spatial_pipelines.core.tree import row_trees_from_parents


    parents, valid, shared, sizes = _random_row_trees(b=8, t=10, seed=3)
    b, t = parents.shape
    v = 6
    depth, kids = max(tr.max_depth for tr in shared), max(tr.max_children for tr in shared)
    trees = row_trees_from_parents(parents, valid, depth, kids)
    with torch.random.fork_rng(devices=[]):  # the same distributions in any test order
        torch.manual_seed(5)
        probs = torch.distributions.Dirichlet(torch.full((v,), 0.7)).sample((b, t))
    tokens = torch.where(valid, torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(4)), -1)
    extra = {"rule": LanternAcceptance(k=2, delta=0.2), "neighbours": codebook_neighbours(torch.randn(v, 3), 2)} if kind == "relaxed" else {}
    out = verify_tree_sequential(trees, tokens, probs, _FixedRandom(b, t, v, depth, kids), **extra)
    checked = 0
    for r, (tr, n) in enumerate(zip(shared, sizes)):
        if tr.max_children == 1:
            continue  # a chain alone takes the chain walk, which uses its draws in another order
        one = verify_tree_sequential(tr, tokens[r : r + 1, :n], probs[r : r + 1, :n], _FixedRandom(b, t, v, depth, kids, rows=[r]), **extra)
        assert out.num_accepted[r] == one.num_accepted[0] and out.bonus[r] == one.bonus[0]
        assert torch.equal(out.path[r, : tr.max_depth + 1], one.path[0])
        assert (out.path[r, tr.max_depth + 1 :] == -1).all()
        checked += 1
    assert checked >= 4 and out.num_accepted.max() > 0  # the comparison is not vacuous
