"""The contract between draft heads and decoders: heads say what they provide, decoders what they need, and one check
(`check_heads`, called by `SpatialDecoderMixin.check_compatibility`) refuses every mismatch with one error."""

from typing import Optional

import pytest
from diffusers.configuration_utils import register_to_config

from spatial_pipelines import (
    ADTTreeDecoder,
    AutoregressiveDecoder,
    DraftHeadsMixin,
    EagleDecoder,
    EagleDraftHead,
    HawkDecoder,
    JacobiDecoder,
    LatentDraftHeads,
    MedusaDecoder,
    SpatialDraftHeads,
    SSDDecoder,
)
from spatial_pipelines.core import DRAFTER, HEADS_KINDS, LATENT, OFFSET_LOGITS, HeadsNeed, HeadsProvide, ImageTokenLayout, check_heads
from spatial_pipelines.heads import heads_class_for

FACTS = {"hidden_size": 16, "num_image_codes": 32, "grid_height": 4, "grid_width": 4}
LAYOUT = ImageTokenLayout(4, 4)


def spatial(h=(), v=()):
    return lambda: SpatialDraftHeads(**FACTS, horizontal_offsets=list(h), vertical_offsets=list(v))


def latent(h=(), v=()):
    return lambda: LatentDraftHeads(**FACTS, horizontal_offsets=list(h), vertical_offsets=list(v))


def drafter():
    return lambda: EagleDraftHead(**FACTS, num_attention_heads=2)


# (decoder, how the error names it, the train command it gives, heads that serve it, heads of a kind it cannot run)
NEEDS_HEADS = [
    pytest.param(MedusaDecoder(num_heads=3, top_k=2), r"MedusaDecoder\(num_heads=3\)", "--kind medusa --num-horizontal 3",
                 spatial((1, 2, 3)), latent((1, 2, 3)), id="medusa"),
    pytest.param(HawkDecoder(num_horizontal_heads=2, vertical_speculation_depth=2, top_k=2),
                 r"HawkDecoder\(num_horizontal_heads=2, vertical_speculation_depth=2\)", "--kind hawk --num-horizontal 2 --vsd 2",
                 spatial((1, 2), (1, 2)), drafter(), id="hawk"),
    pytest.param(SSDDecoder(num_horizontal=3, num_vertical_rows=1), r"SSDDecoder\(num_horizontal=3, num_vertical_rows=1\)",
                 "--kind ssd --num-horizontal 3 --vsd 1", latent((1, 2, 3), (1,)), spatial((1, 2, 3), (1,)), id="ssd"),
    pytest.param(JacobiDecoder(init="heads"), r"JacobiDecoder\(init='heads'\)", "--kind hawk --vsd 1",
                 spatial((), (1,)), drafter(), id="jacobi-heads-spatial"),
    pytest.param(JacobiDecoder(init="heads"), r"JacobiDecoder\(init='heads'\)", "--kind hawk --vsd 1",
                 latent((1,), (1,)), drafter(), id="jacobi-heads-latent"),
    pytest.param(EagleDecoder(depth=2, top_k=2, num_draft_tokens=3), "EagleDecoder", "--kind eagle", drafter(), spatial((1,)), id="eagle"),
    pytest.param(ADTTreeDecoder(depth=2, top_k=2), "ADTTreeDecoder", "--kind eagle", drafter(), latent((1,), (1,)), id="adt"),
]

# (decoder, heads that lack an offset it needs, the missing offsets as the error names them)
LACKING = [
    pytest.param(MedusaDecoder(num_heads=3, top_k=2), spatial((1, 2), (1,)), r"lack the horizontal offsets \[3\]", id="medusa"),
    pytest.param(HawkDecoder(num_horizontal_heads=2, vertical_speculation_depth=2, top_k=2), spatial((1, 2), (1,)),
                 r"lack the vertical offsets \[2\]", id="hawk"),
    pytest.param(SSDDecoder(num_horizontal=3, num_vertical_rows=2), latent((1, 3), (1,)),
                 r"lack the horizontal offsets \[2\] and the vertical offsets \[2\]", id="ssd"),
    pytest.param(SSDDecoder(num_horizontal=2, num_vertical_rows=1), latent((2, 1), (1,)),
                 r"horizontal offsets that begin with \[1, 2\] .*these have \[2, 1\]", id="ssd-latent-order"),
    pytest.param(JacobiDecoder(init="heads"), spatial((1,), (2,)), r"lack the vertical offsets \[1\]", id="jacobi-heads-spatial"),
    pytest.param(JacobiDecoder(init="heads"), latent((1,), (2, 1)), r"vertical offsets that begin with \[1\]", id="jacobi-heads-latent"),
]


@pytest.mark.parametrize("decoder,who,train,right,wrong", NEEDS_HEADS)
def test_decoder_without_heads_gives_the_one_error_naming_it_and_the_fix(decoder, who, train, right, wrong):
    with pytest.raises(ValueError, match=who + r" needs .*; found none\. Load such heads with `pipe\.load_draft_heads\(path_or_repo\)`") as err:
        decoder.check_compatibility(LAYOUT, None)
    assert f"python scripts/train_heads.py {train}`" in str(err.value)


@pytest.mark.parametrize("decoder,who,train,right,wrong", NEEDS_HEADS)
def test_heads_of_the_wrong_kind_are_refused(decoder, who, train, right, wrong):
    heads = wrong()
    with pytest.raises(ValueError, match=who + rf" needs .*; found {type(heads).__name__} \(kind '{heads.provides.kind}'.*cannot serve it"):
        decoder.check_compatibility(LAYOUT, heads)


@pytest.mark.parametrize("decoder,heads,missing", LACKING)
def test_heads_lacking_an_offset_are_refused_naming_it(decoder, heads, missing):
    with pytest.raises(ValueError, match=missing):
        decoder.check_compatibility(LAYOUT, heads())


@pytest.mark.parametrize("decoder,who,train,right,wrong", NEEDS_HEADS)
def test_the_right_heads_pass(decoder, who, train, right, wrong):
    heads = right()
    decoder.check_compatibility(LAYOUT, heads)
    assert heads.provides.kind in decoder.heads_needed().kinds


def test_heads_that_provide_more_than_needed_pass():
    more = spatial((3, 1, 2, 4, 5), (2, 1))()
    for decoder in (MedusaDecoder(num_heads=3, top_k=2), HawkDecoder(num_horizontal_heads=2, top_k=2), JacobiDecoder(init="heads")):
        decoder.check_compatibility(LAYOUT, more)
    SSDDecoder(num_horizontal=3, num_vertical_rows=1).check_compatibility(LAYOUT, latent((1, 2, 3, 4), (1, 2))())


@pytest.mark.parametrize("decoder", [AutoregressiveDecoder(), JacobiDecoder(), JacobiDecoder(init="left")], ids=["ar", "sjd", "sjd-left"])
def test_decoders_that_need_no_heads_pass_with_any_or_none(decoder):
    assert decoder.heads_needed() is None
    decoder.check_compatibility(LAYOUT, None)
    decoder.check_compatibility(LAYOUT, spatial((1,))())


def test_heads_declare_their_kind_and_offsets():
    assert spatial((1, 2), (1,))().provides == HeadsProvide(OFFSET_LOGITS, (1, 2), (1,))
    assert latent((1,), (1, 2))().provides == HeadsProvide(LATENT, (1,), (1, 2))
    assert drafter()().provides == HeadsProvide(DRAFTER)
    assert [heads_class_for(k) for k in HEADS_KINDS] == [SpatialDraftHeads, LatentDraftHeads, EagleDraftHead]
    with pytest.raises(ValueError, match="`kind`"):
        heads_class_for("medusa")


class HeadsWithoutProvides(DraftHeadsMixin):
    """Heads that forget to say what they provide."""

    @register_to_config
    def __init__(self, base_model_name_or_path: Optional[str] = None, base_model_revision: Optional[str] = None, hidden_size: int = 16,
                 num_image_codes: int = 32, grid_height: int = 4, grid_width: int = 4):
        super().__init__()


def test_heads_without_provides_fail_loudly_never_pass():
    heads = HeadsWithoutProvides()
    with pytest.raises(NotImplementedError, match="HeadsWithoutProvides does not say what it provides"):
        heads.provides
    with pytest.raises(NotImplementedError, match="HeadsWithoutProvides"):
        MedusaDecoder(num_heads=1, top_k=1).check_compatibility(LAYOUT, heads)


@pytest.mark.parametrize(
    "make,match",
    [(lambda: HeadsNeed(()), "`kinds`"), (lambda: HeadsNeed(("medusa",)), "`kinds`"), (lambda: HeadsNeed((LATENT,), (0,)), "`horizontal_offsets`"),
     (lambda: HeadsNeed((LATENT,), (), (1, 1)), "`vertical_offsets`"), (lambda: HeadsProvide("heads"), "`kind`"),
     (lambda: HeadsProvide(LATENT, "12"), "`horizontal_offsets`"), (lambda: check_heads("latent", None), "`need`"),
     (lambda: check_heads(HeadsNeed((LATENT,)), object(), provide=(LATENT,)), "`provide`")],
    ids=["no-kinds", "unknown-kind", "offset-0", "repeated-offset", "provide-kind", "offsets-string", "need-type", "provide-type"],
)
def test_contract_arguments_are_checked(make, match):
    with pytest.raises(ValueError, match=match):
        make()
