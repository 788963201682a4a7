"""Families whose image codes are tokens of a transformers vocabulary (Chameleon/Anole, Lumina-mGPT, Emu3) map codes
to tokens by name: a table row per family, the same tests for each."""

import pytest
import torch
from transformers.models.chameleon.modeling_chameleon import ChameleonImageVocabularyMapping
from transformers.models.emu3.modeling_emu3 import Emu3ImageVocabularyMapping

from spatial_pipelines.testing import dummy_pipeline

from helpers import chameleon_code

# family -> (the image-token names in code order, the transformers mapping class built from a vocabulary)
VOCABULARIES = {
    "anole": (lambda vocab: sorted((n for n in vocab if n.startswith("IMGIMG")), key=chameleon_code), ChameleonImageVocabularyMapping),
    "lumina_mgpt": (lambda vocab: sorted((n for n in vocab if n.startswith("IMGIMG")), key=chameleon_code), ChameleonImageVocabularyMapping),
    "emu3": (lambda vocab: sorted(n for n in vocab if n.startswith("<|visual token")), Emu3ImageVocabularyMapping),
}


@pytest.mark.parametrize("family", list(VOCABULARIES))
def test_codes_map_to_image_tokens_by_name(family):
    pipe = dummy_pipeline(family)
    backbone, model = pipe.backbone, pipe.transformer
    vocab = model.config.vocabulary_map
    ids = torch.tensor([vocab[n] for n in VOCABULARIES[family][0](vocab)])
    assert len(ids) == backbone.num_image_codes
    assert not torch.equal(ids, ids[0] + torch.arange(len(ids)))  # the tiny vocabulary shuffles them: no offset
    codes = torch.tensor([[0, 5, 15, 3]])
    torch.testing.assert_close(backbone.embed_image_tokens(codes), model.get_input_embeddings()(ids[codes]))
    hidden = torch.randn(2, 3, backbone.hidden_size)
    torch.testing.assert_close(backbone.output_head(hidden), model.lm_head(hidden)[..., ids])
    assert backbone._index() is backbone._index()  # built once, kept on the pipeline


@pytest.mark.parametrize("family", list(VOCABULARIES))
def test_consecutive_image_ids_use_a_view_of_the_head(family):
    """The released vocabularies number the image tokens consecutively in code order: the head is then a slice of
    lm_head (no copy); the columns must still be in code order."""
    names_in_code_order, mapping_class = VOCABULARIES[family]
    pipe = dummy_pipeline(family)
    model = pipe.transformer
    vocab = dict(model.config.vocabulary_map)
    names = names_in_code_order(vocab)
    first = min(vocab[n] for n in names)
    vocab.update({n: first + i for i, n in enumerate(names)})  # code i -> first + i
    model.config.vocabulary_map = vocab
    model.model.vocabulary_mapping = mapping_class(vocab)
    backbone = pipe.backbone
    assert backbone._index().rows == (first, first + len(names))
    hidden = torch.randn(2, 3, backbone.hidden_size)
    torch.testing.assert_close(backbone.output_head(hidden), model.lm_head(hidden)[..., first : first + len(names)])
