"""Acceptance rules (docs/design.md, "Acceptance rules"): how much of the target distribution ``p`` a drafted code
``x`` may claim when a tree is verified (`verification.py` walks the trees).

The exact rule claims ``p(x)``: committed codes then follow ``p`` exactly. LANTERN and LANTERN++ also claim the mass
of ``x``'s nearest codebook neighbours, within a bound, which moves that mass onto ``x``: the *relaxed* target
``p~_x`` (lossy by design).

A decoder takes ``acceptance=`` as a rule name (``"exact"``, ``"lantern"``, ``"lantern++"``), a dict (``{"name":
"lantern", "k": 1000, "delta": 0.1}``) or a rule object (``LanternAcceptance(k=1000, delta=0.1)``), resolved by
`resolve_acceptance` from `ACCEPTANCE_RULES`, the way peft resolves a LoRA variant or diffusers a scheduler from a
config. A new rule is one subclass of `AcceptanceRule` with its own ``name``: defining it registers it.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Type, Union

import torch

from ..utils import check_number

#: Every rule a decoder's ``acceptance=`` can name: a subclass of `AcceptanceRule` that sets its own ``name`` joins
#: by being defined.
ACCEPTANCE_RULES: Dict[str, Type["AcceptanceRule"]] = {}


@dataclass
class Relaxation:
    """How much of ``p`` each candidate claims under a rule.

    Args:
        mass (`torch.Tensor` `(...)`): ``p~_x(x)``, the candidate's claim (``p(x)`` for the exact rule).
        moved (`torch.Tensor` `(...)`): mass moved onto ``x`` from its kept neighbours (the step's TVD to ``p``).
        neighbours (`torch.LongTensor` `(..., k)`, *optional*): ``x``'s nearest codes, nearest first.
        kept (`torch.BoolTensor` `(..., k)`, *optional*): which of them moved their mass onto ``x``.
    """

    mass: torch.Tensor
    moved: torch.Tensor
    neighbours: Optional[torch.Tensor] = None
    kept: Optional[torch.Tensor] = None

    def select(self, index) -> "Relaxation":
        """The relaxation of the candidates ``index`` picks out of the leading dimensions."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Relaxation(pick(self.mass), pick(self.moved), pick(self.neighbours), pick(self.kept))

    def target(self, probs: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``p~_x``: ``probs`` ``(..., V)`` with the kept neighbours' mass moved onto ``codes`` ``(...)``."""
        if self.kept is None:
            return probs
        pn = probs.gather(-1, self.neighbours)  # (..., k)
        out = probs.scatter(-1, self.neighbours, torch.where(self.kept, 0.0, pn))
        return out.scatter_add(-1, codes[..., None], self.moved[..., None].to(out.dtype))

    def removed(self, probs: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``probs`` ``(..., V)`` less ``codes`` ``(...)`` and their kept neighbours (unnormalised): what is left after a
        point-mass candidate is rejected (``max(p~ - onehot(x), 0)``)."""
        out = probs.scatter(-1, codes[..., None], 0.0)
        if self.kept is None:
            return out
        return out.scatter(-1, self.neighbours, torch.where(self.kept, 0.0, out.gather(-1, self.neighbours)))

    def rejected(self, rest: torch.Tensor, spent: torch.Tensor, scale: torch.Tensor):
        """The step's ledger once this claim is rejected and ``rest`` ``(..., V)`` (unnormalised) is what the next
        sibling is tried against: ``(rest's mass, the TVD used, the scale)``. ``spent`` is in units of the step's
        first ``p`` (this claim's moved mass added, at the scale it was made at); ``scale`` is the mass of that first
        ``p`` the residual stands for (`AcceptanceRule.budget_left` turns both into the next sibling's budget)."""
        total = rest.sum(-1)
        return total, spent + self.moved * scale, scale * total


class AcceptanceRule:
    """The exact rule: a candidate ``x`` claims ``p(x)``; accept with ``min(1, p(x) / q(x))``, on rejection draw
    from ``norm(max(p - q, 0))``. Subclasses claim more (`LanternAcceptance`) and report ``is_exact = False``.

    A subclass is a new rule: it sets ``name`` (its registry key), ``parameters`` (the keyword arguments of its
    ``__init__`` that its config holds, each stored on the object under the same name), ``is_exact``, and
    overrides `relax`. Its ``__init__`` checks its arguments and raises `ValueError` naming the bad one.

    Attributes:
        name (`str`): the config value that resolves to the rule.
        parameters (`tuple[str]`): the rule's settings, as keyword arguments of ``__init__``.
        is_exact (`bool`): committed codes follow ``p`` exactly.
        num_neighbours (`int`): codebook neighbours per code the rule reads (0: none; then no table is built).
        tvd_budget (`float`, *optional*): a TVD bound the siblings of one step share (LANTERN's delta).
        claims_neighbours (`bool`): a relaxed rule's claim is the mass of ``x`` and of the neighbours it keeps
            (`Relaxation.kept`), so one sample of ``p`` decides it: a tree's round on the device tests that sample
            (`verification.sibling_matches`). ``False`` (the default) for a rule that claims mass without naming its
            codes: a tree's round tests each candidate with a keyed uniform of its own and draws the code after the
            accepted path from its residual.
    """

    name = "exact"
    parameters: Tuple[str, ...] = ()
    is_exact = True
    num_neighbours = 0
    tvd_budget: Optional[float] = None
    claims_neighbours = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:  # a helper base class: not a rule of its own
            return
        known = ACCEPTANCE_RULES.get(cls.name)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"An acceptance rule named {cls.name!r} exists already ({known.__qualname__}); give "
                             f"{cls.__qualname__} another `name`.")
        ACCEPTANCE_RULES[cls.name] = cls

    @property
    def relaxes(self) -> bool:
        """Whether the rule claims more than ``p(x)`` (it overrides `relax`): the walks then use ``p~_x``."""
        return type(self).relax is not AcceptanceRule.relax

    def relax(self, probs: torch.Tensor, codes: torch.Tensor, neighbours: Optional[torch.Tensor] = None,
              budget: Optional[torch.Tensor] = None) -> "Relaxation":
        """The claim of ``codes`` ``(...)`` on ``probs`` ``(..., V)``.

        Args:
            neighbours (`torch.Tensor` `(V, >= k)`, *optional*): `codebook_neighbours` (rules that read them).
            budget (`torch.Tensor` `(...)`, *optional*): the TVD still allowed in this step, in ``probs``' units
                (siblings of one step share ``delta``); ``None``: the rule's own bound.
        """
        px = probs.gather(-1, codes[..., None]).squeeze(-1)
        return Relaxation(px, torch.zeros_like(px))

    def budget_left(self, spent: torch.Tensor, scale: torch.Tensor) -> Optional[torch.Tensor]:
        """The TVD a sibling may still move, in units of the residual it is tried against: `tvd_budget` less what its
        earlier siblings moved (``spent``), over the scale of that residual (`Relaxation.rejected`); ``None`` for a
        rule without a shared budget."""
        return None if self.tvd_budget is None else ((self.tvd_budget - spent) / scale).clamp_min(0)

    def to_config(self) -> Union[str, Dict[str, Any]]:
        """What a decoder config stores: the name alone for a rule without settings, else ``{"name": ..., **settings}``
        (a keyword-named setting such as ``lambda_`` is stored as ``lambda``)."""
        if not self.parameters:
            return self.name
        return {"name": self.name, **{p.rstrip("_"): getattr(self, p) for p in self.parameters}}

    @classmethod
    def from_config(cls, settings: Dict[str, Any]) -> "AcceptanceRule":
        """The rule with ``settings`` (config keys: ``lambda`` is passed as ``lambda_``); unknown keys are a `ValueError`."""
        allowed = {p.rstrip("_"): p for p in cls.parameters}
        unknown = sorted(set(settings) - set(allowed))
        if unknown:
            raise ValueError(f"`acceptance` rule {cls.name!r} takes {sorted(allowed) or 'no settings'}, got {unknown}.")
        return cls(**{allowed[k]: v for k, v in settings.items()})

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.to_config() == self.to_config()

    def __hash__(self) -> int:
        return hash((type(self), repr(self.to_config())))

    def __repr__(self) -> str:
        settings = ", ".join(f"{p}={getattr(self, p)!r}" for p in self.parameters)
        return f"{type(self).__name__}({settings})"


ACCEPTANCE_RULES["exact"] = AcceptanceRule
EXACT = AcceptanceRule()


class LanternAcceptance(AcceptanceRule):
    """LANTERN relaxed acceptance (lossy by design; docs/design.md, "Acceptance rules").

    The neighbour set ``A_k(x)`` holds the ``k`` codes nearest to ``x`` in the VQ codebook (at most ``V - 1``),
    nearest first. It is trimmed in distance order while the moved mass stays within the bound ``sum p(kept) <=
    delta`` (that sum is the TVD between ``p`` and ``p~_x``; siblings verified in one step share the budget, so the
    step's TVD stays within ``delta``). The kept mass moves onto ``x``: accept with ``min(1, (p(x) + sum p(kept)) /
    q(x))``; on rejection draw from ``norm(max(p~_x - q, 0))``, which for a point-mass candidate is ``p`` less ``x``
    and the kept neighbours only.

    Args:
        k (`int`): neighbours considered per code (``0``: the exact rule's behaviour).
        delta (`float`): the TVD bound per step, in ``[0, 1]`` (``0``: the exact rule's behaviour).
    """

    name = "lantern"
    parameters = ("k", "delta")
    is_exact = False
    claims_neighbours = True

    def __init__(self, k: int = 1000, delta: float = 0.1):
        check_number('acceptance["k"]', k, 0, integer=True)
        check_number('acceptance["delta"]', delta, 0.0, 1.0)
        self.k, self.delta = k, delta
        self.num_neighbours = k
        self.tvd_budget = delta

    def _bound(self, px: torch.Tensor, budget: Optional[torch.Tensor]) -> torch.Tensor:
        """The most mass the kept neighbours of each candidate may move onto it."""
        return torch.full_like(px, self.delta) if budget is None else budget

    def relax(self, probs, codes, neighbours=None, budget=None) -> "Relaxation":
        px = probs.gather(-1, codes[..., None]).squeeze(-1)  # (...)
        if self.k == 0:
            return Relaxation(px, torch.zeros_like(px))
        if neighbours is None:
            raise ValueError(f"{self!r} needs the codebook neighbour table (`codebook_neighbours`).")
        nb = neighbours[codes, : self.k].long()  # (..., k) nearest first
        pn = probs.gather(-1, nb)  # (..., k) their probabilities
        kept = pn.cumsum(-1) <= self._bound(px, budget)[..., None]  # a prefix in distance order (the sum only grows)
        moved = (pn * kept).sum(-1)
        return Relaxation(px + moved, moved, nb, kept)


class LanternPlusPlusAcceptance(LanternAcceptance):
    """LANTERN++: as `LanternAcceptance`, with the neighbours' claim bounded by the candidate's own probability,
    ``sum p(kept) <= (lambda - 1) p(x)``, instead of a TVD budget per step (lossy by design).

    Args:
        k (`int`): neighbours considered per code.
        lambda_ (`float`): the ratio bound ``p~_x(x) <= lambda * p(x)``, ``>= 1`` (config key ``"lambda"``).
    """

    name = "lantern++"
    parameters = ("k", "lambda_")

    def __init__(self, k: int = 10, lambda_: float = 2.0):
        check_number('acceptance["k"]', k, 0, integer=True)
        check_number('acceptance["lambda"]', lambda_, 1.0)
        self.k, self.lambda_ = k, lambda_
        self.num_neighbours = k
        self.tvd_budget = None

    def _bound(self, px, budget):
        return (self.lambda_ - 1.0) * px


#: Paper settings, to pass as decoder kwargs: ``MedusaDecoder(**LANTERN_PRESETS["llamagen"])``.
LANTERN_PRESETS: Dict[str, Dict] = {
    "llamagen": {"acceptance": {"name": "lantern", "k": 1000, "delta": 0.1}},
    "llamagen-strong": {"acceptance": {"name": "lantern", "k": 1000, "delta": 0.2}},
    "anole": {"acceptance": {"name": "lantern", "k": 100, "delta": 0.5}},
    "lantern++": {"acceptance": {"name": "lantern++", "k": 10, "lambda": 5.0}},
    "lantern++-strong": {"acceptance": {"name": "lantern++", "k": 10, "lambda": 20.0}},
}

AcceptanceLike = Union[str, Dict[str, Any], AcceptanceRule]


def resolve_acceptance(acceptance: AcceptanceLike = "exact") -> AcceptanceRule:
    """The rule ``acceptance`` names: a rule name, ``{"name": ..., **settings}`` or a rule object (returned as is).
    Anything else, an unknown name or a bad setting is a `ValueError` naming the registered rules or the setting."""
    if isinstance(acceptance, AcceptanceRule):
        return acceptance
    if isinstance(acceptance, dict):
        settings = dict(acceptance)
        name = settings.pop("name", None)
    elif isinstance(acceptance, str):
        name, settings = acceptance, {}
    else:
        raise ValueError("`acceptance` must be a rule name, a dict {\"name\": ..., **settings} or an AcceptanceRule, "
                         f"got {acceptance!r}.")
    if name not in ACCEPTANCE_RULES:
        raise ValueError(f"`acceptance` must name one of the registered rules {sorted(ACCEPTANCE_RULES)}, got {name!r}.")
    if name == "exact" and not settings:
        return EXACT  # one object: the walks take their vectorised exact path on sight of it
    return ACCEPTANCE_RULES[name].from_config(settings)


def codebook_neighbours(codebook: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """The ``k`` nearest codes of every code (Euclidean, itself excluded), nearest first: ``(V, min(k, V - 1))``
    int32. Computed in row chunks, so memory stays ``O(chunk * V + V * k)``: never a ``V x V`` table."""
    v = codebook.shape[0]
    k = min(k, v - 1)
    book = codebook.detach().float()
    out = torch.empty(v, k, dtype=torch.int32, device=codebook.device)
    if k == 0:
        return out
    norms = (book * book).sum(-1)  # (V,)
    for start in range(0, v, chunk):
        rows = book[start : start + chunk]  # (c, d)
        dist = norms[start : start + chunk, None] - 2 * rows @ book.T + norms[None]  # (c, V) squared distances
        dist[torch.arange(rows.shape[0]), torch.arange(start, start + rows.shape[0])] = math.inf  # not itself
        out[start : start + chunk] = dist.topk(k, dim=-1, largest=False).indices.to(torch.int32)  # sorted, nearest first
    return out
