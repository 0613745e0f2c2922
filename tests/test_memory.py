"""The memory model asks each family for its own terms (train/memory.py never names a family)."""

import pytest
from omegaconf import OmegaConf
from transformers import LlamaConfig

from specdraft.config import TrainConfig
from specdraft.drafts import FAMILIES
from specdraft.train import memory

TARGET = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def config(family, seq, documents=False):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.draft.type, cfg.max_seq_length, cfg.document_mask = family, seq, documents
    return cfg


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_total_holds_exactly_the_familys_terms(family, monkeypatch):
    cls = FAMILIES[family]
    base = memory.estimate_peak(TARGET, config(family, 1024), world_size=1)
    original = cls.memory_terms
    monkeypatch.setattr(cls, "memory_terms", lambda self, shape: dict(original(self, shape), marker=12345.0))
    marked = memory.estimate_peak(TARGET, config(family, 1024), world_size=1)
    assert marked.parts["marker"] == 12345.0 and marked.total == pytest.approx(base.total + 12345.0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_familys_term_grows_faster_than_t_with_packed_documents(family):
    """Doubling T at most doubles every term a family keeps (DFlash's blocks stop growing at
    max_anchors), document borders included: no family builds a (T, T) mask on CUDA."""
    from specdraft.drafts import build_draft
    from specdraft.drafts.base import MemoryShape

    draft = build_draft(config(family, 4096).draft, TARGET)
    at = {T: draft.memory_terms(MemoryShape(B=1, T=T, dtype_bytes=2, chunk=1024, documents=True, target=TARGET))
          for T in (4096, 8192)}
    for name, value in at[8192].items():
        assert at[4096][name] <= value <= 2 * at[4096][name] + 1, name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_documents_cost_no_square_term(family):
    """No family's attention builds a (T, T) document mask on CUDA (flex_attention block masks) or
    CPU (per-conversation slices; drafts/documents.py): with borders, the same terms."""
    from specdraft.drafts import build_draft
    from specdraft.drafts.base import MemoryShape

    draft = build_draft(config(family, 4096).draft, TARGET)
    terms = {docs: draft.memory_terms(MemoryShape(B=1, T=8192, dtype_bytes=2, chunk=1024, documents=docs,
                                                  target=TARGET)) for docs in (False, True)}
    assert terms[True] == terms[False]


def test_with_packed_documents_only_the_targets_mask_is_added():
    """The target's (B, 1, T, T) mask of the capture is the one square term left."""
    plain = memory.estimate_peak(TARGET, config("glide", 4096), world_size=1)
    cfg = config("glide", 4096, documents=True)
    packed = memory.estimate_peak(TARGET, cfg, world_size=1)
    assert packed.total - plain.total == packed.parts["document masks"] == cfg.per_device_batch_size * 4096 * 4096


def test_the_memory_model_never_names_a_family():
    source = memory.__file__
    text = open(source).read().lower()
    assert not any(name in text for name in FAMILIES), source


def test_the_zero_buckets_are_even_whatever_the_drafts_parameter_count():
    """ZeRO-1/2 assert allgather_bucket_size % 2 == 0; DSpark's confidence bias makes its count odd."""
    from specdraft.train.memory import REDUCE_BUCKET, reduce_bucket_elements

    assert [reduce_bucket_elements(n) for n in (1, 8, 1_780_001)] == [8, 8, 1_780_008]
    assert reduce_bucket_elements(10 ** 10) == REDUCE_BUCKET
