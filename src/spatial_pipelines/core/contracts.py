"""What draft heads provide, what decoders need, and the one check between them.

Heads declare a `HeadsProvide` (their ``provides`` property), a decoder a `HeadsNeed` (its ``heads_needed()``), and
`check_heads` compares the two before a generation starts, with one error that says what is missing and how to get
it. This module imports neither the heads nor the decoders: both sides import it.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..utils import check_choice

#: Token-logit heads at horizontal/vertical offsets (`SpatialDraftHeads`: Medusa, Hawk), run by offset.
OFFSET_LOGITS = "offset_logits"
#: Latent predictors of the backbone's hidden state at offsets (`LatentDraftHeads`: SSD); they also give logits at
#: their offsets through the backbone's head. They run by position: a decoder uses the first ``n`` of a direction.
LATENT = "latent"
#: A drafter model fed the target's features (`EagleDraftHead`: EAGLE-2, ADT), no fixed offsets.
DRAFTER = "drafter"
#: Every kind of heads, in this order.
HEADS_KINDS = (OFFSET_LOGITS, LATENT, DRAFTER)

_KIND_TEXT = {
    OFFSET_LOGITS: "token-logit heads at offsets (SpatialDraftHeads)",
    LATENT: "latent heads (LatentDraftHeads)",
    DRAFTER: "a drafter (EagleDraftHead)",
}


def as_offsets(name: str, offsets: Sequence[int]) -> Tuple[int, ...]:
    """``offsets`` as a tuple of distinct ints >= 1; `ValueError` naming ``name`` otherwise.

    Args:
        name (`str`): the argument's name, for the message.
        offsets (`Sequence[int]`): the offsets to check.
    """
    if isinstance(offsets, (str, bytes)) or not hasattr(offsets, "__iter__"):
        raise ValueError(f"`{name}` must be a list of distinct ints >= 1, got {offsets!r}.")
    offsets = tuple(offsets)
    if any(not isinstance(o, int) or isinstance(o, bool) or o < 1 for o in offsets) or len(set(offsets)) != len(offsets):
        raise ValueError(f"`{name}` must hold distinct ints >= 1, got {list(offsets)!r}.")
    return offsets


@dataclass(frozen=True)
class HeadsProvide:
    """What a set of draft heads gives a decoder.

    Args:
        kind (`str`): one of `HEADS_KINDS`: ``"offset_logits"`` (token logits at offsets, looked up by offset),
            ``"latent"`` (predicted hidden states, hence logits, at offsets; a decoder runs the first ``n`` of a
            direction) or ``"drafter"`` (a draft model).
        horizontal_offsets (`tuple[int]`): raster offsets the heads draft (``k``: the code ``k`` positions on).
        vertical_offsets (`tuple[int]`): row offsets the heads draft (``d``: the code ``d`` rows below).
    """

    kind: str
    horizontal_offsets: Tuple[int, ...] = ()
    vertical_offsets: Tuple[int, ...] = ()

    def __post_init__(self):
        check_choice("kind", self.kind, HEADS_KINDS)
        object.__setattr__(self, "horizontal_offsets", as_offsets("horizontal_offsets", self.horizontal_offsets))
        object.__setattr__(self, "vertical_offsets", as_offsets("vertical_offsets", self.vertical_offsets))

    def describe(self) -> str:
        """``kind`` and its offsets, for messages."""
        parts = [f"kind {self.kind!r}"]
        for direction in ("horizontal", "vertical"):
            offsets = getattr(self, f"{direction}_offsets")
            if offsets or self.kind != DRAFTER:
                parts.append(f"{direction} offsets {list(offsets)}")
        return ", ".join(parts)


@dataclass(frozen=True)
class HeadsNeed:
    """What a decoder needs from draft heads.

    Args:
        kinds (`tuple[str]`): the `HEADS_KINDS` the decoder can run, preferred first (at least one).
        horizontal_offsets (`tuple[int]`): raster offsets it drafts with.
        vertical_offsets (`tuple[int]`): row offsets it drafts with.
        who (`str`): the decoder and the settings that make it need these, for messages
            (``"MedusaDecoder(num_heads=4)"``).
    """

    kinds: Tuple[str, ...]
    horizontal_offsets: Tuple[int, ...] = ()
    vertical_offsets: Tuple[int, ...] = ()
    who: str = "the decoder"

    def __post_init__(self):
        if isinstance(self.kinds, str) or not hasattr(self.kinds, "__iter__") or not tuple(self.kinds):
            raise ValueError(f"`kinds` must be a non-empty tuple of {HEADS_KINDS}, got {self.kinds!r}.")
        object.__setattr__(self, "kinds", tuple(self.kinds))
        for kind in self.kinds:
            check_choice("kinds", kind, HEADS_KINDS)
        object.__setattr__(self, "horizontal_offsets", as_offsets("horizontal_offsets", self.horizontal_offsets))
        object.__setattr__(self, "vertical_offsets", as_offsets("vertical_offsets", self.vertical_offsets))
        if not isinstance(self.who, str):
            raise ValueError(f"`who` must be a string, got {self.who!r}.")

    def describe(self) -> str:
        """The kinds and offsets needed, for messages."""
        text = " or ".join(_KIND_TEXT[k] for k in self.kinds)
        offsets = [f"{d} offsets {list(getattr(self, f'{d}_offsets'))}" for d in ("horizontal", "vertical")
                   if getattr(self, f"{d}_offsets")]
        return text + (" with " + " and ".join(offsets) if offsets else "")

    def train_command(self) -> str:
        """The ``scripts/train_heads.py`` command that trains heads of the preferred kind with these offsets."""
        kind = self.kinds[0]
        h, v = self.horizontal_offsets, self.vertical_offsets
        if kind == DRAFTER:
            return "python scripts/train_heads.py --kind eagle"
        flag = "ssd" if kind == LATENT else ("hawk" if v else "medusa")
        command = f"python scripts/train_heads.py --kind {flag}"
        if h:
            command += f" --num-horizontal {max(h)}"
        if v:
            command += f" --vsd {max(v)}"
        return command


def missing_offsets(need: HeadsNeed, provide: HeadsProvide) -> Tuple[str, ...]:
    """What ``provide`` lacks of ``need``'s offsets, one text per direction (empty: nothing). Latent heads run by
    position, so theirs must begin with the needed ones, in order."""
    missing = []
    for direction in ("horizontal", "vertical"):
        wanted, have = getattr(need, f"{direction}_offsets"), getattr(provide, f"{direction}_offsets")
        absent = sorted(set(wanted) - set(have))
        if absent:
            missing.append(f"the {direction} offsets {absent}")
        elif provide.kind == LATENT and wanted and have[: len(wanted)] != wanted:
            missing.append(f"{direction} offsets that begin with {list(wanted)} (latent heads run their first "
                           f"{len(wanted)} in order; these have {list(have)})")
    return tuple(missing)


def check_heads(need: Optional[HeadsNeed], heads, provide: Optional[HeadsProvide] = None) -> None:
    """Raise one `ValueError` unless ``heads`` serve ``need``: who needs what, what was found, what is missing and how
    to fix it. Heads that provide more than needed pass; ``need=None`` (no heads needed) always passes.

    Args:
        need (`HeadsNeed`, *optional*): what the decoder needs (its ``heads_needed()``).
        heads: the loaded draft heads, or ``None``.
        provide (`HeadsProvide`, *optional*): what ``heads`` provide (default: ``heads.provides``).
    """
    if need is None:
        return
    if not isinstance(need, HeadsNeed):
        raise ValueError(f"`need` must be a HeadsNeed or None, got {type(need).__name__}.")
    if heads is not None and provide is None:
        provide = heads.provides
    if provide is not None and not isinstance(provide, HeadsProvide):
        raise ValueError(f"`provide` must be a HeadsProvide, got {type(provide).__name__}.")
    if heads is None:
        found, problem = "none", ""
    else:
        found = f"{type(heads).__name__} ({provide.describe()})"
        if provide.kind not in need.kinds:
            problem = f"; {provide.kind!r} heads cannot serve it"
        else:
            missing = missing_offsets(need, provide)
            if not missing:
                return
            problem = "; they lack " + " and ".join(missing)
    raise ValueError(
        f"`draft_heads`: {need.who} needs {need.describe()}; found {found}{problem}. Load such heads with "
        f"`pipe.load_draft_heads(path_or_repo)`, or train them with `{need.train_command()}`."
    )
