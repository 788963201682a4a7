import pytest
import torch

from reference import chi_square_pvalue
from spatial_pipelines.core import RandomSource
from spatial_pipelines.core.acceptance import residual, verify_tree
from spatial_pipelines.core.tree import chain_tree, tree_from_parents, tree_from_paths


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
    acc = verify_tree(tree, tokens, probs, RandomSource(torch.Generator().manual_seed(0), 1, "cpu"))
    assert acc.path.tolist() == [[0, 2, -1]] and acc.num_accepted.tolist() == [1] and acc.bonus.tolist() == [0]
    tokens = torch.tensor([[9, 2, 1, 3, 4]])  # a right, then aa (=3) right
    acc = verify_tree(tree, tokens, probs, RandomSource(torch.Generator().manual_seed(0), 1, "cpu"))
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
    acc = verify_tree(tree, tokens, probs, RandomSource(torch.Generator().manual_seed(3), N, "cpu"), q)
    first = torch.where(acc.num_accepted > 0, tokens.gather(1, acc.path[:, 1:2].clamp_min(0)).squeeze(1), acc.bonus)
    counts = torch.bincount(first, minlength=v)
    assert chi_square_pvalue(counts, probs[0, 0]) > 1e-4
    # the statistic has power: a biased rule (over-accepting point masses, or the wrong q) is caught
    wrong_q = torch.full_like(probs, 0.5) if q is None else q.roll(1, dims=-1)
    wrong = verify_tree(tree, tokens, probs, RandomSource(torch.Generator().manual_seed(3), N, "cpu"), wrong_q)
    first_wrong = torch.where(wrong.num_accepted > 0, tokens.gather(1, wrong.path[:, 1:2].clamp_min(0)).squeeze(1), wrong.bonus)
    assert chi_square_pvalue(torch.bincount(first_wrong, minlength=v), probs[0, 0]) < 1e-4


def test_residual():
    p, q = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.6, 0.2]])
    torch.testing.assert_close(residual(p, q), torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.equal(residual(p, p), p)  # nothing left: unchanged (never used by exact acceptance)
