"""Acceptance rules (docs/design.md, "Acceptance rules" and "Invariants"): the exact rule, LANTERN and LANTERN++, the
rule registry, and configs of earlier versions.

The relaxed rules are checked against an independent reference written here (a plain Python walk over one step's
siblings), on random distributions, and end to end on the tiny enumerable model.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from spatial_pipelines import ADTTreeDecoder, EagleDecoder, HawkDecoder, JacobiDecoder, MedusaDecoder
from spatial_pipelines.core import SamplingConfig
from spatial_pipelines.core.acceptance import (
    ACCEPTANCE_RULES,
    EXACT,
    LANTERN_PRESETS,
    AcceptanceRule,
    LanternAcceptance,
    LanternPlusPlusAcceptance,
    Relaxation,
    codebook_neighbours,
    resolve_acceptance,
)
from spatial_pipelines.core.tree import chain_tree, tree_from_parents
from helpers.walks import RandomSource, verify_tree_sequential
from spatial_pipelines.pipelines.device_chain import relaxed_chain
from spatial_pipelines.core.verification import sibling_matches, tree_tables
from spatial_pipelines.testing import dummy_pipeline
from spatial_pipelines.utils import check_number

from helpers import DISTRIBUTION_SAMPLES, chi_square_pvalue, exact_joint_distribution, gen, grid_index

V = 12


def _random_setup(seed, v=V, d=3):
    g = torch.Generator().manual_seed(seed)
    book = torch.randn(v, d, generator=g)
    probs = torch.distributions.Dirichlet(torch.full((v,), 0.6)).sample((64,))  # (N, V) varied shapes
    codes = torch.randint(0, v, (64,), generator=g)
    return book, probs, codes


# -- the neighbour table -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,chunk", [(3, 1024), (5, 4), (100, 5)])
def test_codebook_neighbours_match_brute_force(k, chunk):
    book = torch.randn(30, 4, generator=torch.Generator().manual_seed(0))
    table = codebook_neighbours(book, k, chunk=chunk)
    dist = torch.cdist(book, book)
    dist.fill_diagonal_(math.inf)
    ref = dist.argsort(-1)[:, : min(k, 29)]
    assert table.shape == (30, min(k, 29)) and table.dtype == torch.int32
    assert torch.equal(table.long(), ref)  # nearest first, itself excluded


def test_neighbour_table_is_built_once_per_codebook():
    pipe = dummy_pipeline("llamagen", MedusaDecoder(acceptance={"name": "lantern", "k": 3}), "random")
    backbone = pipe.backbone
    first = backbone.code_neighbours(3)
    assert pipe.backbone.code_neighbours(3) is first  # cached on the pipeline, across adapter instances
    assert pipe.backbone.code_neighbours(2) is first  # a larger table serves a smaller k
    with torch.no_grad():
        pipe.vqvae.quantize.embedding.weight.mul_(-1.0).add_(0.5)
    assert pipe.backbone.code_neighbours(3) is not first  # new weights: rebuilt


# -- the rule objects --------------------------------------------------------------------------------------------
def test_rules_resolve_from_a_name_a_dict_or_an_object():
    assert resolve_acceptance("exact") is EXACT and resolve_acceptance({"name": "exact"}) is EXACT and EXACT.is_exact
    lantern = resolve_acceptance({"name": "lantern", "k": 7, "delta": 0.2})
    assert isinstance(lantern, LanternAcceptance) and not lantern.is_exact
    assert (lantern.k, lantern.delta, lantern.tvd_budget, lantern.num_neighbours) == (7, 0.2, 0.2, 7)
    assert resolve_acceptance("lantern") == LanternAcceptance()  # the rule's own defaults
    plus = resolve_acceptance({"name": "lantern++", "k": 7, "lambda": 3.0})
    assert isinstance(plus, LanternPlusPlusAcceptance) and plus.lambda_ == 3.0 and plus.tvd_budget is None
    rule = LanternAcceptance(k=5, delta=0.3)
    assert resolve_acceptance(rule) is rule
    assert set(ACCEPTANCE_RULES) >= {"exact", "lantern", "lantern++"}
    for preset in LANTERN_PRESETS.values():
        assert not MedusaDecoder(**preset).is_exact


@pytest.mark.parametrize("decoder_cls", [MedusaDecoder, HawkDecoder, JacobiDecoder, EagleDecoder, ADTTreeDecoder])
@pytest.mark.parametrize("acceptance", ["exact", "lantern", {"name": "lantern++", "k": 4, "lambda": 3.0}, LanternAcceptance(k=5, delta=0.3)],
                         ids=["name", "name-with-settings", "dict", "object"])
def test_decoder_config_saves_the_rule_as_json_and_loads_it_back(decoder_cls, acceptance, tmp_path):
    decoder = decoder_cls(acceptance=acceptance)
    decoder.save_config(tmp_path)
    loaded = decoder_cls.from_pretrained(tmp_path)
    assert loaded.acceptance_rule == decoder.acceptance_rule == resolve_acceptance(acceptance)
    assert loaded.config.acceptance == decoder.acceptance_rule.to_config()
    assert isinstance(decoder.config.acceptance, (str, dict))  # JSON, whatever form was passed


def test_is_exact_is_a_property_of_the_instance():
    assert MedusaDecoder().is_exact and not MedusaDecoder(acceptance="lantern").is_exact
    assert HawkDecoder().is_exact and not HawkDecoder(acceptance="lantern++").is_exact
    assert JacobiDecoder().is_exact and not JacobiDecoder(acceptance="lantern").is_exact
    # a decoder class that forgets to resolve a rule keeps the exact one; a rule that lies about exactness cannot
    # hide: `is_exact` reads the rule each time
    decoder = MedusaDecoder()
    decoder.acceptance_rule = LanternAcceptance(k=3, delta=0.1)
    assert not decoder.is_exact


BAD_ACCEPTANCE = [
    ("relaxed", "registered rules"),
    ({"k": 3}, "registered rules"),  # no name
    (3, "rule name"),
    ({"name": "lantern", "kk": 3}, "takes"),
    ({"name": "lantern", "lambda": 3.0}, "takes"),
    ({"name": "lantern", "k": -1}, 'acceptance\\["k"\\]'),
    ({"name": "lantern", "k": 2.5}, 'acceptance\\["k"\\]'),
    ({"name": "lantern", "k": True}, 'acceptance\\["k"\\]'),
    ({"name": "lantern", "delta": -0.1}, 'acceptance\\["delta"\\]'),
    ({"name": "lantern", "delta": 1.5}, 'acceptance\\["delta"\\]'),
    ({"name": "lantern", "delta": float("nan")}, 'acceptance\\["delta"\\]'),
    ({"name": "lantern++", "lambda": 0.5}, 'acceptance\\["lambda"\\]'),
    ({"name": "lantern++", "lambda": float("inf")}, 'acceptance\\["lambda"\\]'),
    ({"name": "lantern++", "lambda": "2"}, 'acceptance\\["lambda"\\]'),
]


@pytest.mark.parametrize("decoder_cls", [MedusaDecoder, HawkDecoder, JacobiDecoder])
@pytest.mark.parametrize("acceptance,message", BAD_ACCEPTANCE, ids=[str(i) for i in range(len(BAD_ACCEPTANCE))])
def test_bad_acceptance_config_raises(decoder_cls, acceptance, message):
    with pytest.raises(ValueError, match=message):
        decoder_cls(acceptance=acceptance)


@pytest.mark.parametrize("delta", [0.05, 0.2, 0.5])
def test_lantern_step_tvd_never_exceeds_delta(delta):
    """Invariant 4: ``TVD(p, p~_x) = sum p(kept) <= delta`` for every candidate, and the kept set is the longest
    prefix of the neighbours (in distance order) within the bound."""
    book, probs, codes = _random_setup(0)
    rule = LanternAcceptance(k=6, delta=delta)
    table = codebook_neighbours(book, 6)
    relaxed = rule.relax(probs, codes, table)
    target = relaxed.target(probs, codes)
    tvd = 0.5 * (target - probs).abs().sum(-1)
    assert torch.allclose(target.sum(-1), torch.ones(len(probs)))
    assert (tvd <= delta + 1e-6).all()
    torch.testing.assert_close(tvd, relaxed.moved)
    pn = probs.gather(-1, table[codes].long())
    n_kept = relaxed.kept.sum(-1)
    assert torch.equal(relaxed.kept, torch.arange(6)[None] < n_kept[:, None])  # a prefix
    longer = pn.cumsum(-1).gather(-1, n_kept.clamp_max(5)[:, None]).squeeze(-1)
    assert ((n_kept == 6) | (longer > delta)).all()  # one more neighbour would break the bound
    assert (tvd > 0).any()  # the rule is not vacuous on these distributions


@pytest.mark.parametrize("lam", [1.5, 4.0])
def test_lantern_plus_plus_ratio_bound(lam):
    book, probs, codes = _random_setup(1)
    rule = LanternPlusPlusAcceptance(k=6, lambda_=lam)
    relaxed = rule.relax(probs, codes, codebook_neighbours(book, 6))
    px = probs.gather(-1, codes[:, None]).squeeze(-1)
    assert (relaxed.mass <= lam * px + 1e-6).all()
    assert (relaxed.mass > px).any()


def test_zero_delta_or_zero_k_claims_exactly_p():
    book, probs, codes = _random_setup(2)
    table = codebook_neighbours(book, 6)
    px = probs.gather(-1, codes[:, None]).squeeze(-1)
    for rule in (LanternAcceptance(k=6, delta=0.0), LanternAcceptance(k=0, delta=0.3), LanternPlusPlusAcceptance(k=6, lambda_=1.0)):
        relaxed = rule.relax(probs, codes, table)
        torch.testing.assert_close(relaxed.mass, px)
        torch.testing.assert_close(relaxed.removed(probs, codes), probs.scatter(-1, codes[:, None], 0.0))


@pytest.mark.parametrize("tree_kind", ["siblings", "chain"])
@pytest.mark.parametrize("rule", [LanternAcceptance(k=4, delta=0.0), LanternAcceptance(k=0, delta=0.4)], ids=["delta0", "k0"])
def test_relaxed_rule_at_zero_reproduces_exact_acceptance(rule, tree_kind):
    """Same random numbers, same outcome as the exact rule (the sequential walk, the reference the device rounds are
    tested against)."""
    book, _, _ = _random_setup(3)
    table = codebook_neighbours(book, 4)
    tree = chain_tree(3) if tree_kind == "chain" else tree_from_parents([-1, 0, 0, 0, 1, 1, 4], [-1, 0, 1, 2, 0, 1, 0])
    n, t = 500, tree.num_nodes
    probs = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((n, t))
    tokens = torch.randint(0, V, (n, t), generator=torch.Generator().manual_seed(4))
    ref = verify_tree_sequential(tree, tokens, probs, RandomSource(gen(9), n, "cpu"))
    out = verify_tree_sequential(tree, tokens, probs, RandomSource(gen(9), n, "cpu"), rule=rule, neighbours=table)
    assert torch.equal(out.path, ref.path) and torch.equal(out.bonus, ref.bonus)


def _reference_step(p, codes, table, delta):
    """One step of relaxed point-mass verification over sibling ``codes``, in plain Python: the output distribution
    (every sibling tried in turn against the residual; the siblings share the TVD budget ``delta``)."""
    p = [float(x) for x in p]
    out = [0.0] * len(p)
    left, spent = 1.0, 0.0  # mass of the original p still in play; TVD used so far
    for x in codes:
        claim, moved, kept = p[x], 0.0, []
        for y in table[x]:
            if moved + p[y] > delta - spent + 1e-12:
                break
            moved += p[y]
            kept.append(y)
        out[x] += claim + moved  # accepted with (p(x) + moved) / left, in units of the original p
        spent += moved
        for y in [x] + kept:
            p[y] = 0.0
        left -= claim + moved
    return [o + left * pi / max(sum(p), 1e-30) for o, pi in zip(out, p)], spent


@pytest.mark.parametrize("delta", [0.1, 0.3])
def test_lantern_siblings_output_matches_the_reference_and_the_bound(delta):
    """One verification step over three point-mass siblings, 60,000 times: the committed code follows the reference
    walk's distribution (chi-square, p > 1e-4), whose TVD to ``p`` is within ``delta`` and not zero."""
    g = torch.Generator().manual_seed(5)
    book = torch.randn(V, 3, generator=g)
    table = codebook_neighbours(book, 5)
    p = torch.distributions.Dirichlet(torch.full((V,), 1.0)).sample()
    codes = [3, 7, 1]
    expected, spent = _reference_step(p.tolist(), codes, table.tolist(), delta)
    expected = torch.tensor(expected, dtype=torch.float64)
    assert 0 < 0.5 * (expected - p.double()).abs().sum() <= delta + 1e-6
    assert abs(0.5 * (expected - p.double()).abs().sum().item() - spent) < 1e-6

    n = 60000
    tree = tree_from_parents([-1, 0, 0, 0], [-1, 0, 1, 2])
    probs = p.expand(n, 4, V).contiguous()
    tokens = torch.tensor([0] + codes).expand(n, 4)
    acc = verify_tree_sequential(tree, tokens, probs, RandomSource(gen(6), n, "cpu"), rule=LanternAcceptance(k=5, delta=delta), neighbours=table)
    first = torch.where(acc.num_accepted > 0, tokens.gather(1, acc.path[:, 1:2].clamp_min(0)).squeeze(1), acc.bonus)
    counts = torch.bincount(first, minlength=V)
    assert chi_square_pvalue(counts, expected) > 1e-4


def _dirichlet_ones(n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` draws of Dirichlet(1, ..., 1) over ``V`` codes from ``g`` (normalised exponentials)."""
    e = torch.empty(n, V).exponential_(generator=g)
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("delta", [0.1, 0.3])
def test_the_device_rounds_relaxed_tree_test_follows_the_reference_step(delta):
    """The device rounds' LANTERN for a tree (`sibling_matches`): three point-mass siblings tested by one sample of
    the parent's ``p`` each (60,000 rows): at most one sibling matches, and the committed code (the matching sibling,
    else the sample) follows the reference walk's distribution (chi-square, p > 1e-4)."""
    g = torch.Generator().manual_seed(5)
    table = codebook_neighbours(torch.randn(V, 3, generator=g), 5)
    p = _dirichlet_ones(1, g)[0]
    codes = [3, 7, 1]
    expected = torch.tensor(_reference_step(p.tolist(), codes, table.tolist(), delta)[0], dtype=torch.float64)
    n = 60000
    tree = tree_from_parents([-1, 0, 0, 0], [-1, 0, 1, 2])
    tables = tree_tables(tree, torch.arange(4))
    y = torch.multinomial(p, n, replacement=True, generator=g)  # (n,) the root's sample
    samples = torch.stack([y, y, y, y], 1)  # only the root's is read (the children are leaves)
    fed = torch.tensor([0] + codes).expand(n, 4)
    seeds, index = torch.arange(n), torch.ones(n, 4, dtype=torch.long)  # a named claim reads no uniform
    matches, _ = sibling_matches(LanternAcceptance(k=5, delta=delta), table, p.expand(n, 4, V), fed, tables, seeds, index,
                                 samples=samples)
    assert matches[:, 0].all() and (matches[:, 1:].sum(1) <= 1).all()
    first = torch.where(matches[:, 1:].any(1), fed[:, 1:].gather(1, matches[:, 1:].long().argmax(1, keepdim=True))[:, 0], y)
    assert chi_square_pvalue(torch.bincount(first, minlength=V), expected) > 1e-4
    # a first sibling that claims all of p leaves nothing for the later ones
    everything = LanternAcceptance(k=V - 1, delta=1.0)
    matches, _ = sibling_matches(everything, codebook_neighbours(torch.randn(V, 3, generator=g), V - 1), p.expand(n, 4, V),
                                 fed, tables, seeds, index, samples=samples)
    assert matches[:, 1].all() and not matches[:, 2:].any()


@pytest.mark.parametrize("floor", [0.12, 0.5])
def test_the_device_rounds_test_a_claim_that_names_no_codes_with_uniforms_of_their_own(floor):
    """A rule whose claim names no codes (`FloorAcceptance`, below) on a tree of three point-mass siblings
    (`sibling_matches`, 60,000 rows, each its own seed): sibling after sibling, each with a keyed uniform against its
    claim on its parent's residual, none after one that matched, and a row that accepts none commits a keyed draw from
    the residual left after all three: the committed code follows the sequential walk's law (chi-square, p > 1e-4)."""
    from spatial_pipelines.core.sampling import RESIDUAL_STREAM, keyed_sample
    from spatial_pipelines.pipelines.device_chain import UNIT_SAMPLING

    g = torch.Generator().manual_seed(9)
    p = _dirichlet_ones(1, g)[0]
    codes = [int(c) for c in p.argsort()[[4, 7, 10]]]  # the least likely first: a residual may lift a later one to the floor
    rule = FloorAcceptance(floor)
    expected, left = torch.zeros(V, dtype=torch.float64), p.double()  # the walk's law, sibling by sibling
    reach = 1.0
    for x in codes:
        relaxed = rule.relax(left[None].float(), torch.tensor([x]))
        accept = min(1.0, relaxed.mass.item())
        expected[x] += reach * accept
        reach *= 1 - accept
        rest = relaxed.removed(left[None].float(), torch.tensor([x]))[0].double()
        left = rest / rest.sum()
    expected += reach * left
    n = 60000
    tree = tree_from_parents([-1, 0, 0, 0], [-1, 0, 1, 2])
    tables = tree_tables(tree, torch.arange(4))
    seeds, index = torch.arange(n) * 7919 + 13, torch.full((n, 4), 5, dtype=torch.long)
    fed = torch.tensor([0] + codes).expand(n, 4)
    matches, residual = sibling_matches(rule, None, p.expand(n, 4, V), fed, tables, seeds, index)
    assert matches[:, 0].all() and (matches[:, 1:].sum(1) <= 1).all()
    drawn = keyed_sample(residual[:, 0].log(), UNIT_SAMPLING, seeds ^ RESIDUAL_STREAM, index[:, 0])  # (n,) the root's
    first = torch.where(matches[:, 1:].any(1), fed[:, 1:].gather(1, matches[:, 1:].long().argmax(1, keepdim=True))[:, 0], drawn)
    assert chi_square_pvalue(torch.bincount(first, minlength=V), expected) > 1e-4


@pytest.mark.parametrize("rule", [LanternAcceptance(k=5, delta=0.2), LanternPlusPlusAcceptance(k=5, lambda_=3.0)],
                         ids=["lantern", "lantern++"])
def test_the_device_rounds_relaxed_chain_is_speculative_sampling_of_the_relaxed_target(rule):
    """The device rounds' relaxed test of a chain's draft (`relaxed_chain`): a draft ``x ~ q`` is kept when a keyed
    uniform ``u < p~_x(x) / q(x)``, else its position takes a keyed draw from ``norm(max(p~_x - q, 0))``. Over 60,000
    rows (each its own seed) the committed code follows ``sum_x q(x) [a_x [c = x] + (1 - a_x) r_x(c)]`` (chi-square,
    p > 1e-4); a row that keeps the draft commits a keyed draw from the next position's ``p`` after it."""
    g = torch.Generator().manual_seed(11)
    table = codebook_neighbours(torch.randn(V, 3, generator=g), 5)
    p, p_next, q = _dirichlet_ones(3, g)
    q = q**3 / (q**3).sum()  # a peaked proposal: its likely drafts claim less than their q, so some are rejected
    expected = torch.zeros(V, dtype=torch.float64)
    for x in range(V):  # the law of the committed code, draft by draft
        one = torch.tensor([x])
        relaxed = rule.relax(p[None], one, table)
        accept = min(1.0, relaxed.mass.item() / q[x].item())
        rest = (relaxed.target(p[None], one)[0] - q).clamp_min(0).double()
        rest = rest / rest.sum() if rest.sum() > 0 else p.double()
        expected += q[x].double() * (accept * torch.nn.functional.one_hot(one, V)[0].double() + (1 - accept) * rest)
    n = 60000
    drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]  # (n, 1)
    state = SimpleNamespace(drafts=drafts, q=q.expand(n, 1, V), seeds=torch.arange(n) * 7919 + 3)
    loop = SimpleNamespace(state=state, rule=rule, window=1, neighbours=table, code_offsets=torch.arange(2))
    probs = torch.stack([p, p_next]).expand(n, 2, V)
    commit, matches = relaxed_chain(loop, probs, torch.tensor([[4, 5]]).expand(n, 2))
    assert chi_square_pvalue(torch.bincount(commit[:, 0], minlength=V), expected) > 1e-4
    kept = matches == 1
    assert torch.equal(commit[kept, 0], drafts[kept, 0]) and 0 < kept.float().mean() < 1
    assert chi_square_pvalue(torch.bincount(commit[kept, 1], minlength=V), p_next) > 1e-4


def test_relaxed_acceptance_never_draws_a_code_outside_the_image_codes():
    book, probs, codes = _random_setup(7)
    tree = chain_tree(2)
    probs = probs[:60].reshape(20, 3, V)
    tokens = torch.randint(0, V, (20, 3))
    acc = verify_tree_sequential(tree, tokens, probs, RandomSource(gen(1), 20, "cpu"), rule=LanternAcceptance(k=4, delta=0.5),
                      neighbours=codebook_neighbours(book, 4))
    assert ((acc.bonus >= 0) & (acc.bonus < V)).all()


# -- end to end on the tiny model ----------------------------------------------------------------------------------
N_SAMPLES = 12000


def _first_drafted_marginal(pipe, seed):
    out = pipe("a fox", guidance_scale=2.0, num_images_per_prompt=N_SAMPLES, generator=gen(seed), output_type="latent")
    return torch.bincount(out.tokens.reshape(N_SAMPLES, -1)[:, 1], minlength=pipe.backbone.num_image_codes).double()


def test_lantern_output_tvd_grows_with_delta_within_the_bound():
    """Medusa with LANTERN on an 8-code model: at the first drafted position (the second code; the first comes
    from the prefill pass) the output's TVD to the model's own marginal stays within ``delta`` and grows with it."""
    pipe = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=3, num_draft_tokens=6), "random", grid=(2, 2), num_codes=8)
    sampling = SamplingConfig(2.0, 1.0)
    joint = exact_joint_distribution(pipe, "a fox", sampling).reshape(8, 8, 8, 8)
    marginal = joint.sum((0, 2, 3)).double()  # the AR marginal of code 1
    tvds = {}
    for delta in (0.0, 0.2, 0.5):
        pipe.decoder = MedusaDecoder(num_heads=2, top_k=3, num_draft_tokens=6, acceptance={"name": "lantern", "k": 7, "delta": delta})
        freq = _first_drafted_marginal(pipe, seed=3) / N_SAMPLES
        tvds[delta] = 0.5 * (freq - marginal).abs().sum().item()
    noise = 0.03  # sampling noise of an 8-bin TVD estimate from 12,000 draws is about 0.01
    assert tvds[0.0] < noise
    assert tvds[0.2] <= 0.2 + noise and tvds[0.5] <= 0.5 + noise
    assert tvds[0.0] < tvds[0.2] < tvds[0.5], tvds


@pytest.mark.parametrize(
    "decoder",
    [MedusaDecoder(num_draft_tokens=6, acceptance={"name": "lantern", "k": 3, "delta": 0.0}),
     JacobiDecoder(window_size=3, acceptance={"name": "lantern", "k": 0}),
     HawkDecoder(num_draft_tokens=6, acceptance={"name": "lantern++", "k": 3, "lambda": 1.0})],
    ids=["medusa-delta0", "sjd-k0", "hawk-lambda1"],
)
@pytest.mark.parametrize("device_rounds", [None, False], ids=["device-rounds", "row-groups"])
def test_relaxed_rules_at_zero_keep_the_model_distribution(decoder, device_rounds):
    """Invariant 4, end to end: with nothing to move, the relaxed rules sample the model's own joint (the chi-square
    test of invariant 2, ``DISTRIBUTION_SAMPLES`` samples, p > 1e-4), in rounds on the device (their keyed tests) and
    in row groups (drawn uniforms)."""
    heads = None if isinstance(decoder, JacobiDecoder) else "random"
    pipe = dummy_pipeline("llamagen", decoder, heads, grid=(2, 2), num_codes=4)
    pipe.device_rounds = device_rounds
    sampling = SamplingConfig(2.0, 1.0)
    exact = exact_joint_distribution(pipe, "a fox", sampling)
    out = pipe("a fox", guidance_scale=2.0, num_images_per_prompt=DISTRIBUTION_SAMPLES, generator=gen(1), output_type="latent")
    counts = torch.bincount(grid_index(out.tokens, 4), minlength=4**4)
    assert chi_square_pvalue(counts, exact) > 1e-4


@pytest.mark.parametrize("decoder_cls,heads", [(MedusaDecoder, "random"), (HawkDecoder, "random"), (JacobiDecoder, None)])
def test_relaxed_rules_are_greedy_exact(decoder_cls, heads):
    """Under greedy decoding ``p`` is a point mass: neighbours carry nothing and LANTERN accepts exactly."""
    size = {"window_size": 4} if decoder_cls is JacobiDecoder else {"num_draft_tokens": 8}
    pipe = dummy_pipeline("llamagen", decoder_cls(acceptance={"name": "lantern", "k": 5, "delta": 0.5}, **size), heads, grid=(4, 5))
    out = pipe(["a fox", "b"], temperature=0, output_type="latent")
    pipe.decoder = decoder_cls(**size)
    assert torch.equal(out.tokens, pipe(["a fox", "b"], temperature=0, output_type="latent").tokens)


# -- a new rule is one class (the worked example of docs/design.md, "Adding an acceptance rule") ------------------
class FloorAcceptance(AcceptanceRule):
    """A toy lossy rule: a candidate whose probability reaches ``floor`` is accepted outright."""

    name = "toy-floor"
    parameters = ("floor",)
    is_exact = False

    def __init__(self, floor: float = 0.5):
        check_number('acceptance["floor"]', floor, 0.0)
        self.floor = floor

    def relax(self, probs, codes, neighbours=None, budget=None) -> Relaxation:
        px = probs.gather(-1, codes[..., None]).squeeze(-1)  # (...)
        mass = torch.where(px >= self.floor, torch.ones_like(px), px)
        return Relaxation(mass, mass - px)


@pytest.mark.parametrize("decoder_cls,size", [(MedusaDecoder, {"num_draft_tokens": 6}), (JacobiDecoder, {"window_size": 4})])
def test_a_new_rule_joins_by_being_defined_and_runs_through_the_decoders(decoder_cls, size, tmp_path):
    assert ACCEPTANCE_RULES["toy-floor"] is FloorAcceptance
    pipe = dummy_pipeline("llamagen", decoder_cls(**size), "random" if decoder_cls is MedusaDecoder else None, grid=(4, 5))
    exact = pipe("a fox", temperature=0, output_type="latent")
    # a floor no probability reaches claims p(x) only: greedy output is the model's own
    pipe.decoder = decoder_cls(acceptance={"name": "toy-floor", "floor": 2.0}, **size)
    assert not pipe.decoder.is_exact and pipe.decoder.acceptance_rule == FloorAcceptance(2.0)
    assert pipe("a fox", temperature=0, output_type="latent").tokens.equal(exact.tokens)
    # a floor of 0 accepts every draft: fewer passes, other codes
    pipe.decoder = decoder_cls(acceptance=FloorAcceptance(0.0), **size)
    relaxed = pipe("a fox", temperature=0, output_type="latent")
    assert relaxed.stats.num_forward_passes < exact.stats.num_forward_passes
    # saved as JSON, loaded back as the same rule; a bad setting names itself
    pipe.decoder.save_config(tmp_path)
    assert decoder_cls.from_pretrained(tmp_path).acceptance_rule == FloorAcceptance(0.0)
    with pytest.raises(ValueError, match='acceptance\\["floor"\\]'):
        decoder_cls(acceptance={"name": "toy-floor", "floor": -1.0})
