"""Spatially Speculative Decoding (SSD): lossy by design, O(H) target passes instead of O(H*W).

The first row is drafted horizontally in chunks; every later row is drafted at once, one code per column, from
the completed row above by vertical latent predictors; drafted rows are then repaired by ``r`` rounds of
"verification as auto-correction" (every position tested on its own, rejected ones redrawn from the residual,
the KV cache rolled back) and committed by one last pass.

Schedule (target passes; the prefill pass draws code 0):

* first row: chunks of ``m = min(num_horizontal, codes left in the row - 1)`` horizontal drafts; each chunk takes
  ``horizontal_rounds`` verification passes plus one commit pass, which also draws the code after the chunk
  from its last output (so a chunk commits ``m + 1`` codes, and a chunk of 0 drafts is one AR step);
* ``num_vertical_rows == 1``: every later row takes ``vertical_rounds + 1`` passes;
* ``num_vertical_rows = g > 1`` (staged): a group of ``g`` rows takes ``b`` rounds on all rows, then for each
  of its rows but the last a commit pass of the leading row followed by ``i`` rounds on the rows left, then the
  final commit pass: ``b + (g - 1) * (1 + i) + 1`` passes (``b = staged_base_rounds``,
  ``i = staged_incremental_rounds``; the last group of the image may be shorter).

No pass depends on what an earlier one accepted, so `SSDDecoder.plan` writes the passes out before the
first (`SSDPass`), and the pipelines run them on the device, every row in lockstep, each draw keyed by the image's
seed (`spatial_pipelines.pipelines.device_ssd`).

Indexing used by heads and decoder alike: ``h_j`` is the pre-norm hidden state whose logits drew code ``j``; a
predictor fed ``[h_j; e(x_j)]`` drafts code ``j + k`` (horizontal offset ``k``) or ``j + d * W`` (vertical
offset ``d``).
"""

from dataclasses import dataclass
from typing import List, Optional

from diffusers.configuration_utils import register_to_config

from ..core.contracts import LATENT, HeadsNeed
from ..utils import check_choice, check_number
from .decoding_utils import SpatialDecoderMixin, check_draft_budget

__all__ = ["SSD_PRESETS", "SSDDecoder"]  # what `spatial_pipelines.decoders` exports from this file

DRAFT_MODES = ("argmax", "sample")
#: The most verification rounds a drafted row (or group of rows) may take: each is a target pass, so past a grid row's
#: width a row costs more passes than decoding it code by code (the paper uses 1 to 6; the widest grid served, Emu3's,
#: is 90 codes).
MAX_ROUNDS = 128

#: The paper's per-model settings (Table 9), usable with `SSDDecoder.from_preset`.
SSD_PRESETS = {
    "janus_pro": dict(num_horizontal=5, horizontal_rounds=1, num_vertical_rows=1, vertical_rounds=2),
    "lumina_mgpt": dict(num_horizontal=5, horizontal_rounds=1, num_vertical_rows=2, staged_base_rounds=5, staged_incremental_rounds=4),
    "emu3": dict(num_horizontal=5, horizontal_rounds=1, num_vertical_rows=1, vertical_rounds=6),
}


@dataclass(frozen=True)
class SSDPass:
    """One target pass of SSD's schedule, known before the first (it does not depend on what the passes accept).

    Args:
        committed (`int`): codes committed before the pass; the newest, ``committed - 1``, is fed first.
        fed (`int`): codes fed after it: the whole block (a verification pass), or the codes a commit pass commits.
        commit (`bool`): a commit pass (its fed codes stay in the KV cache), else a verification pass (rolled back).
        bonus (`bool`): the commit pass also draws the code after the fed ones from its last output.
        draft (`str`, *optional*): ``"horizontal"`` or ``"vertical"``: the pass first drafts a new block from the
            committed codes (``drafted`` horizontal offsets, or ``drafted`` rows).
        drafted (`int`): offsets the draft uses (0: no draft).
        block (`int`): codes in the block being repaired during the pass (a staged commit moves the rest forward).
    """

    committed: int
    fed: int
    commit: bool
    bonus: bool = False
    draft: Optional[str] = None
    drafted: int = 0
    block: int = 0

    @property
    def shape(self) -> tuple:
        """Everything but where the pass is: passes of one shape run one graph."""
        return (self.fed, self.commit, self.bonus, self.draft, self.drafted, self.block)


@dataclass(frozen=True)
class SSDSchedule:
    """What a loop on the device needs of SSD (`SSDDecoder.plan`).

    Args:
        passes (`list[SSDPass]`): every target pass after the prompt's, in order.
        sample_drafts (`bool`): drafts are drawn from the heads' distribution (``draft="sample"``), else their argmax.
    """

    passes: List[SSDPass]
    sample_drafts: bool


class SSDDecoder(SpatialDecoderMixin):
    r"""Spatially Speculative Decoding with `LatentDraftHeads`.

    Args:
        num_horizontal (`int`): horizontal drafts per chunk on the first row (k_h; the heads need offsets
            ``1..num_horizontal``).
        horizontal_rounds (`int`): verification rounds per first-row chunk.
        vertical_rounds (`int`): verification rounds ``r`` per later row when ``num_vertical_rows == 1``; also
            the default of the staged rounds.
        num_vertical_rows (`int`): rows drafted per iteration (k_v; the heads need vertical offsets
            ``1..num_vertical_rows``).
        staged_base_rounds (`int`, *optional*): ``b``, rounds on all rows of a group (default: ``vertical_rounds``).
        staged_incremental_rounds (`int`, *optional*): ``i``, rounds on the rows left after each leading row is
            committed (default: ``vertical_rounds``).
        draft (`str`): ``"argmax"`` (the paper: drafts are the heads' argmax, verified as point masses) or
            ``"sample"`` (drafts drawn from the heads' distribution ``q`` under the sampling settings, verified
            with ``min(1, p/q)``).
    """

    short_name = "ssd"  # the CLI's and benchmark specs' name (`DECODERS`)

    lossless = False  # verification as auto-correction: positions do not wait for their left neighbours

    @register_to_config
    def __init__(self, num_horizontal: int = 5, horizontal_rounds: int = 1, vertical_rounds: int = 2,
                 num_vertical_rows: int = 1, staged_base_rounds: Optional[int] = None,
                 staged_incremental_rounds: Optional[int] = None, draft: str = "argmax"):
        super().__init__()
        for name, value, low in (("num_horizontal", num_horizontal, 1), ("horizontal_rounds", horizontal_rounds, 0),
                                 ("vertical_rounds", vertical_rounds, 0), ("num_vertical_rows", num_vertical_rows, 1),
                                 ("staged_base_rounds", staged_base_rounds, 0),
                                 ("staged_incremental_rounds", staged_incremental_rounds, 0)):
            check_number(name, value, low, integer=True, optional=name.startswith("staged"))
            if value is not None and value > MAX_ROUNDS:
                raise ValueError(f"`{name}={value}`: at most {MAX_ROUNDS} verification rounds (each is a target pass; "
                                 "past a row's width a row costs more passes than decoding it code by code).")
        check_choice("draft", draft, DRAFT_MODES)
        check_draft_budget(f"`num_horizontal={num_horizontal}`", 1 + num_horizontal)
        check_draft_budget(f"`num_vertical_rows={num_vertical_rows}` (rows of a vertical block)", 1 + num_vertical_rows)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "SSDDecoder":
        """The paper's settings for a model family (``SSD_PRESETS``: janus_pro, lumina_mgpt, emu3)."""
        check_choice("name", name, sorted(SSD_PRESETS))
        return cls(**{**SSD_PRESETS[name], **overrides})

    @property
    def base_rounds(self) -> int:
        c = self.config
        return c.vertical_rounds if c.staged_base_rounds is None else c.staged_base_rounds

    @property
    def incremental_rounds(self) -> int:
        c = self.config
        return c.vertical_rounds if c.staged_incremental_rounds is None else c.staged_incremental_rounds

    @property
    def max_draft_tokens(self) -> int:
        return 1  # blocks never pass the end of the grid, so the cache needs no slack beyond it

    def max_fed_tokens(self, layout) -> int:
        """The newest code and the largest block: a horizontal chunk or ``num_vertical_rows`` rows of codes."""
        c = self.config
        return 1 + max(c.num_horizontal, min(c.num_vertical_rows, layout.height) * layout.width)

    def heads_needed(self) -> HeadsNeed:
        """Latent heads whose offsets begin with ``1..num_horizontal`` and ``1..num_vertical_rows``."""
        c = self.config
        return HeadsNeed((LATENT,), tuple(range(1, c.num_horizontal + 1)), tuple(range(1, c.num_vertical_rows + 1)),
                         self._who("num_horizontal", "num_vertical_rows"))

    def plan(self, draft_heads, layout, batch_size: int, device, drawn: bool = False) -> SSDSchedule:
        """Every target pass after the prompt's on ``layout``, in order (the module docstring's schedule), written out
        before the first pass, like a diffusers scheduler's timesteps: the engine runs them in lockstep over the rows
        (`spatial_pipelines.pipelines.device_ssd.SSDLoop`)."""
        c, w, h = self.config, layout.width, layout.height
        passes: List[SSDPass] = []
        done = 1  # the prompt pass draws code 0
        while done < w:  # first row: chunks of m drafts, then the code after them
            m = min(c.num_horizontal, w - done - 1)
            draft = dict(draft="horizontal", drafted=m, block=m) if m else {}
            for _ in range(c.horizontal_rounds if m else 0):
                passes.append(SSDPass(done, m, False, **draft))
                draft = dict(block=m)
            passes.append(SSDPass(done, m, True, bonus=True, **draft))
            done += m + 1
        while done < h * w:  # later rows: g at once, drafted from the row above
            g = min(c.num_vertical_rows, h - done // w)
            draft = dict(draft="vertical", drafted=g)
            for k in range(g):  # the block holds the rows left; its leading row is committed after the rounds
                block = (g - k) * w
                for _ in range(self.base_rounds if k == 0 else self.incremental_rounds):
                    passes.append(SSDPass(done, block, False, block=block, **draft))
                    draft = {}
                passes.append(SSDPass(done, w, True, block=block, **draft))
                draft = {}
                done += w
        return SSDSchedule(passes, sample_drafts=c.draft == "sample")

    # -- drafting --------------------------------------------------------------------------------------
    # -- verification and commit -----------------------------------------------------------------------
