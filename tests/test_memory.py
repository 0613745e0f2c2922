"""The memory model asks each family for its own terms (train/memory.py never names a family)."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, Qwen3NextConfig

from helpers import loss_step_peak_against_model

from specdraft.train.live_bytes import LiveTensorBytes
from specdraft.config import TrainConfig
from specdraft.drafts.registry import FAMILIES
from specdraft.train import memory

TARGET = LlamaConfig(
    vocab_size=8000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
# the same size as a qwen3_next (MoE MLPs, gated attention), for a family that drafts only for it (MTP)
QWEN3_NEXT = Qwen3NextConfig(
    vocab_size=8000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    layer_types=["full_attention"] * 4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    tie_word_embeddings=False,
)


def target_of(family):
    return TARGET if FAMILIES[family].drafts_for("llama") else QWEN3_NEXT


def config(family, seq, documents=False):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.draft.type, cfg.max_seq_length, cfg.document_mask = family, seq, documents
    return cfg


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_total_holds_exactly_the_familys_terms(family, monkeypatch):
    cls = FAMILIES[family]
    base = memory.estimate_peak(target_of(family), config(family, 1024), world_size=1)
    original = cls.memory_terms
    monkeypatch.setattr(cls, "memory_terms", lambda self, shape: dict(original(self, shape), marker=12345.0))
    marked = memory.estimate_peak(target_of(family), config(family, 1024), world_size=1)
    assert marked.parts["marker"] == 12345.0 and marked.total == pytest.approx(base.total + 12345.0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_familys_term_grows_faster_than_t_with_packed_documents(family):
    """Doubling T at most doubles every term a family keeps (DFlash's blocks stop growing at
    max_anchors), document borders included: no family builds a (T, T) mask on CUDA."""
    from specdraft.drafts.registry import build_draft
    from specdraft.drafts.base import MemoryShape

    draft = build_draft(config(family, 4096).draft, target_of(family))
    at = {
        T: draft.memory_terms(
            MemoryShape(B=1, T=T, dtype_bytes=2, chunk=1024, documents=True, target=target_of(family))
        )
        for T in (4096, 8192)
    }
    for name, value in at[8192].items():
        assert at[4096][name] <= value <= 2 * at[4096][name] + 1, name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_documents_cost_no_square_term(family):
    """No family's attention builds a (T, T) document mask on CUDA (flex_attention block masks) or
    CPU (per-conversation slices; target/attention.py): with borders, no term is new or larger
    (GLIDE's window band is the one term borders remove: each conversation is attended alone)."""
    from specdraft.drafts.registry import build_draft
    from specdraft.drafts.base import MemoryShape

    draft = build_draft(config(family, 4096).draft, target_of(family))
    terms = {
        docs: draft.memory_terms(
            MemoryShape(B=1, T=8192, dtype_bytes=2, chunk=1024, documents=docs, target=target_of(family))
        )
        for docs in (False, True)
    }
    assert no_term_new_or_larger(terms[True], terms[False])


def no_term_new_or_larger(packed: dict, plain: dict) -> bool:
    return all(name in plain and value <= plain[name] for name, value in packed.items())


def test_packed_documents_add_no_square_term():
    """The capture's core attention is document-aware: no (B, 1, T, T) mask is counted for it."""
    plain = memory.estimate_peak(TARGET, config("eagle3", 4096), world_size=1)
    packed = memory.estimate_peak(TARGET, config("eagle3", 4096, documents=True), world_size=1)
    assert packed.parts == plain.parts
    plain = memory.estimate_peak(TARGET, config("glide", 4096), world_size=1)
    packed = memory.estimate_peak(TARGET, config("glide", 4096, documents=True), world_size=1)
    assert no_term_new_or_larger(packed.parts, plain.parts) and "window mask" in plain.parts


def test_the_memory_model_never_names_a_family():
    source = memory.__file__
    text = open(source).read().lower()
    assert not any(name in text for name in FAMILIES), source


def test_the_zero_buckets_are_even_whatever_the_drafts_parameter_count():
    """ZeRO-1/2 assert allgather_bucket_size % 2 == 0; DSpark's confidence bias makes its count odd."""
    from specdraft.train.memory import REDUCE_BUCKET, reduce_bucket_elements

    assert [reduce_bucket_elements(n) for n in (1, 8, 1_780_001)] == [8, 8, 1_780_008]
    assert reduce_bucket_elements(10**10) == REDUCE_BUCKET


# -- the terms against the tensors a step really holds -------------------------------------------


def test_live_tensor_bytes_follow_storages_not_views():
    before = torch.empty(4000)
    with LiveTensorBytes() as live:
        a = torch.empty(1000)
        del a
        b = torch.empty(1000)
        view = b.view(10, 100)
        del b
        c = torch.empty(500)
        before.detach().t_()  # shares a storage made before: nothing allocated
    assert (live.peak, live.live) == (6000, 6000) and view.shape == (10, 100) and c.numel() == 500


FIXED = ("target weights", "draft weights", "draft grads", "optimizer (fp32 master + Adam m, v)")


@pytest.mark.parametrize(
    "family,precision", [(family, "fp32") for family in sorted(FAMILIES)] + [("glide", "bf16"), ("eagle3", "bf16")]
)
def test_the_familys_terms_are_the_tensors_a_training_step_holds(family, precision):
    """One training forward and backward (capture, draft, loss; each family at its defaults,
    T = 256, at bf16 T = 128: bf16 matmuls are slow on a CPU without native bf16, and the terms
    checked are per token): the peak of live tensor bytes is within 10% of what the model adds above weights,
    gradients and optimizer state. This pins each family's per-token counts (DFlash's loss one block slot per
    call, RMSNorm's fp32 inputs at bf16, a teacher objective's 7 chunks, EAGLE-3's teacher rows).
    DFlash's and DSpark's block mask becomes a float bias in the query dtype (2 B at bf16), which
    its term counts at 4 B: they are checked at fp32 here."""
    from specdraft.drafts.registry import build_draft
    from specdraft.train.model import TargetWithDraft
    from transformers import AutoModelForCausalLM

    T = 256 if precision == "fp32" else 128
    cfg = config(family, T)
    cfg.precision, cfg.per_device_batch_size = precision, 1
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    torch.manual_seed(0)
    target_config = target_of(family)
    target = AutoModelForCausalLM.from_config(target_config).eval().requires_grad_(False).to(dtype)
    model = TargetWithDraft(target, build_draft(cfg.draft, target_config).to(dtype), cfg.loss_chunk_size)
    peak, predicted, parts = loss_step_peak_against_model(model, target_config, cfg, FIXED, T)
    assert peak == pytest.approx(predicted, rel=0.10), {k: f"{v / 2**20:.1f} MiB" for k, v in parts.items()}


@pytest.mark.parametrize("loss,buffers", [("kl", 7), ("soft_ce", 7), ("0.9*tv + 0.1*ce", 7)])
def test_a_teacher_objective_holds_seven_fp32_chunks_at_once(loss, buffers):
    """objectives.objective_terms on one chunk: the student's and the teacher's logits, both
    log-softmaxes, both softmaxes and one product or gradient, as MemoryShape.loss_chunk counts."""
    from specdraft.drafts.base import MemoryShape
    from specdraft.drafts.objectives import chunked_objective
    from specdraft.drafts.objective_options import parse_objective

    rows, vocab, hidden = 64, 2000, 32
    objective = parse_objective(loss, where="test")
    student = torch.randn(rows, hidden, requires_grad=True)
    weight, teacher = torch.randn(vocab, hidden), torch.randn(rows, hidden)
    labels = torch.randint(0, vocab, (rows,)) if objective.needs_labels else None
    with LiveTensorBytes() as live:
        chunked_objective(student, weight, teacher, weight, labels, objective, chunk_size=rows)
    shape = MemoryShape(B=1, T=rows, dtype_bytes=4, chunk=rows, documents=False, target=None)
    assert shape.loss_chunk(rows, vocab, hidden, teacher=True) == rows * 2 * hidden * 4 + rows * vocab * 4 * buffers
    assert live.peak == pytest.approx(rows * vocab * 4 * buffers, rel=0.10)


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda"])
def test_an_lk_objective_holds_nine_fp32_chunks_at_once(loss):
    """The LK losses over a draft vocab (the target's whole-vocab normaliser given): the seven of a
    teacher objective, the unrenormalised probabilities and the acceptance's derivative; forward
    and the recomputing backward."""
    from specdraft.drafts.base import MemoryShape
    from specdraft.drafts.objectives import chunked_objective
    from specdraft.drafts.objective_options import parse_objective

    rows, vocab, hidden = 64, 2000, 32
    student = torch.randn(rows, hidden, requires_grad=True)
    weight, teacher = torch.randn(vocab, hidden), torch.randn(rows, hidden)
    with LiveTensorBytes() as live:
        out = chunked_objective(
            student,
            weight,
            teacher,
            weight,
            None,
            parse_objective(loss),
            chunk_size=rows,
            teacher_lse=torch.randn(rows) + 10,
        )
        out.loss.backward()
    shape = MemoryShape(B=1, T=rows, dtype_bytes=4, chunk=rows, documents=False, target=None)
    assert shape.loss_chunk(rows, vocab, hidden, teacher=True, lk=True) == rows * 2 * hidden * 4 + rows * vocab * 4 * 9
    assert live.peak == pytest.approx(rows * vocab * 4 * 9, rel=0.10)


SEQUENCE_FAMILIES = ("dflash", "dspark", "eagle3", "glide", "peagle")  # those that train on sequence shards


@pytest.mark.parametrize(
    "T,window,S,expected",
    [
        (512, 512, 1, 0),  # one window: causal attention, no mask
        (768, 512, 1, 768 * 768),  # up to two windows: one (T, T) band
        (2048, 512, 1, 2 * 4 * 512 * 1024),  # blocks of (W, 2W), per row (B = 2)
        (2048, 512, 2, 2 * 4 * 512 * 1024),  # SP: each rank attends the whole sequence with its heads
        (1000, 512, 2, 1000 * 1000),  # a shard under the window, the sequence over it
    ],
)
def test_glides_window_mask_is_the_band_sdpa_holds_over_the_whole_sequence(T, window, S, expected):
    """One conversation per row: the float bias (4 B at fp32) of layers.sliding_window_attention's
    band; packed rows have none (slices on CPU, a flex block mask on CUDA)."""
    cfg = config("glide", T)
    cfg.draft.sliding_window, cfg.per_device_batch_size = window, 2
    one = memory.estimate_peak(TARGET, cfg, world_size=S, sequence_parallel=S).parts
    assert one.get("window mask", 0) == expected * 4
    assert (
        "window mask"
        not in memory.estimate_peak(TARGET, config("glide", T, documents=True), world_size=S, sequence_parallel=S).parts
    )


def test_capture_working_set_under_sequence_parallelism_is_a_hand_count():
    """TARGET: H 256, I 688, 4 heads, 2 kv heads, head_dim 64; fp32; a rank's 512 tokens."""
    plain = 512 * ((2 * 256 + 2 * 4 * 64 + 2 * 2 * 64 + 3 * 688) * 4 + 2 * 256 * 4)
    assert memory.capture_working_set(TARGET, 512, 4) == plain
    assert (
        memory.capture_working_set(TARGET, 512, 4, sequence_parallel=2) == plain + 512 * (2 * 4 * 64 + 2 * 2 * 64) * 4
    )


@pytest.mark.parametrize("family", SEQUENCE_FAMILIES)
def test_sequence_parallel_terms_equal_a_hand_count(family):
    """SP = 2 at T: weights, gradients and optimizer state as at SP = 1; no (T, T) document mask;
    the family's per-token terms those of the half sequence, except an all-gathered context
    (DFlash, DSpark: fc's output and its norm 2H, per layer its keys/values 6 kv hd, and the block
    mask's keys), which is the whole sequence's."""
    from specdraft.drafts.registry import build_draft
    from specdraft.drafts.base import MemoryShape, target_text_config

    T, p = 1024, 4
    B = config(family, T).per_device_batch_size
    sp = memory.estimate_peak(TARGET, config(family, T, documents=True), world_size=2, sequence_parallel=2)
    whole = memory.estimate_peak(TARGET, config(family, T, documents=True), world_size=2)
    for name in ("target weights", "draft weights", "draft grads", "optimizer (fp32 master + Adam m, v)"):
        assert sp.parts[name] == whole.parts[name]
    draft = build_draft(config(family, T).draft, TARGET)
    common = dict(B=B, dtype_bytes=p, chunk=1024, documents=True, target=target_text_config(TARGET))
    shard = draft.memory_terms(MemoryShape(T=T // 2, whole_T=T, **common))
    half = draft.memory_terms(MemoryShape(T=T // 2, **common))
    own = draft.memory_terms(MemoryShape(T=T, **common)).get("document masks", 0)
    # the capture builds no (B, 1, T, T) mask: only the family's own document term
    assert whole.parts.get("document masks", 0) == own
    assert sp.parts.get("document masks", 0) == shard.get("document masks", 0)
    if family in ("glide", "eagle3"):  # head-split attention: every term is the shard's
        assert shard == half
        return
    if family == "peagle":  # the shard's slots against the gathered depth-0 keys, through a dense mask
        # defaults K = 8, r = 0.7, r_min = 0.2: slots per token 1 + .7 + .7^2 + .7^3 + .7^4 + 3 x .2;
        # TARGET: 2 kv heads of 64, H = Ht = 256; kl reads the teacher
        n = 512 * (1 + 0.7 + 0.7**2 + 0.7**3 + 0.7**4 + 3 * 0.2)  # the rank's slots
        keys = 1024 + (n - 512)  # every depth-0 key of the sequence, then the rank's deeper slots
        assert shard["slot attention"] == pytest.approx(B * keys * (2 * 2 * 64 + n) * p)  # K/V, fp32 mask bias
        assert shard["shard borders"] == B * (513 * 256 + (512 + 8) * 256) * p  # x_{a+1}; teacher to a+8
        assert {k: v for k, v in shard.items() if k not in ("slot attention", "shard borders")} == {
            k: v for k, v in half.items() if k != "slot attention"
        }
        return
    d = draft.dims
    # a rank may hold every anchor of the sequence (the answers in its shard): the bound, as a half
    # sequence with all of them would
    gathered = B * (T - T // 2) * (2 * d.hidden_size + d.num_layers * 6 * d.num_kv_heads * d.head_dim) * p
    slots = B * min(d.max_anchors, T // 2) * d.block_size
    layers = 1 if draft.gradient_checkpointing else d.num_layers
    assert shard["draft activations"] == half["draft activations"] + gathered
    assert shard["block mask"] == half["block mask"] + slots * (T - T // 2) * (1 + 4 * layers)
    assert {k: v for k, v in shard.items() if k not in ("draft activations", "block mask")} == {
        k: v for k, v in half.items() if k not in ("draft activations", "block mask")
    }


# -- mixture-of-experts and windowed targets -------------------------------------------------------

QWEN3_MOE = dict(
    vocab_size=8000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    tie_word_embeddings=False,
)


def test_a_moe_targets_capture_holds_its_routed_activations_a_hand_count():
    """Qwen3-MoE, fp32, a rank's 512 tokens: the dense layer's terms with the MLP's 3I replaced by
    the routed activations, top_k = 2 per token, each the gathered input and the expert's gate/up
    and product (H + 3 x 128), and the router's logits and fp32 softmax over 8 experts."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    attention = (2 * 256 + 2 * 4 * 64 + 2 * 2 * 64) * 4 + 2 * 256 * 4
    routed = 2 * (256 + 3 * 128) * 4 + 8 * (4 + 4)
    assert memory.mlp_working_bytes(Qwen3MoeConfig(**QWEN3_MOE), 4) == routed
    assert memory.capture_working_set(Qwen3MoeConfig(**QWEN3_MOE), 512, 4) == 512 * (attention + routed)
    # DeepSeek-V3-like: a dense first layer (first_k_dense_replace 1) of intermediate 688 is the larger
    # MLP; the shared expert (2 x 128) runs after the routed ones, beside their output
    deepseek = DeepseekV3Config(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        moe_intermediate_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    )
    assert memory.mlp_working_bytes(deepseek, 4) == max(routed, (3 * 256 + 256) * 4, 3 * 688 * 4) == 3 * 688 * 4
    deepseek.first_k_dense_replace = 0  # every layer sparse: the routed activations
    assert memory.mlp_working_bytes(deepseek, 4) == routed


def test_every_experts_weights_are_resident_a_hand_count():
    """The target's weights count every expert of every sparse layer (a token may be routed to any):
    Qwen3-MoE of 4 layers, per layer attention q/k/v/o and q/k norms, two RMSNorms, the router
    (8 x 256) and 8 experts' gate/up (2 x 128 x 256) and down (256 x 128); embeddings, lm_head, norm."""
    from transformers import Qwen3MoeConfig

    attention = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 2 * 64
    experts = 8 * (2 * 128 * 256 + 256 * 128)
    layer = attention + 2 * 256 + 8 * 256 + experts
    params = 4 * layer + 2 * 8000 * 256 + 256
    target = Qwen3MoeConfig(**QWEN3_MOE)
    est = memory.estimate_peak(target, config("eagle3", 1024), world_size=1)
    assert est.parts["target weights"] == params * 4
    counts = memory.parameter_counts(target, config("eagle3", 1024).draft)
    assert counts["target_layer"] == layer  # what a ZeRO-3 partitioned target gathers per layer


def test_a_windowed_layers_attention_is_bounded_by_its_window():
    """One sequence per row: the capture's core computes a windowed layer's scores in tiles of W
    queries over up to 2W - 1 keys (2p + 4 B each: scores, masked copy, fp32 softmax), the same at
    any T past the window; with packed documents (flex_attention on CUDA) none. gpt-oss's full layers
    with sinks: tiles of 128 queries over the keys before them, one more p for the sink column."""
    from transformers import GptOssConfig, MistralConfig

    mistral = MistralConfig(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=512,
    )
    tile = 2 * 4 * 512 * (2 * 512 - 1) * (2 * 2 + 4)  # B = 2, 4 heads, bf16
    assert memory.attention_tile_bytes(mistral, 2, 4096, 2, documents=False) == tile
    assert memory.attention_tile_bytes(mistral, 2, 65536, 2, documents=False) == tile
    assert memory.attention_tile_bytes(mistral, 2, 512, 2, documents=False) == 0  # within the window: causal SDPA
    assert memory.attention_tile_bytes(mistral, 2, 65536, 2, documents=True) == 0
    assert memory.attention_tile_bytes(mistral, 2, 65536, 2, documents=False, sequence_parallel=2) == tile // 2
    gpt_oss = GptOssConfig(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=128,
    )
    assert memory.attention_tile_bytes(gpt_oss, 1, 4096, 2, documents=False) == 4 * 128 * 4096 * (3 * 2 + 4)


def test_the_attention_tile_is_part_of_the_captures_working_set(monkeypatch):
    from transformers import MistralConfig

    mistral = MistralConfig(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=512,
    )
    monkeypatch.setattr(memory, "capture_working_set", lambda *args: 1e12)  # the largest transient here
    rows = memory.estimate_peak(mistral, config("eagle3", 4096), world_size=1, documents=False)
    packed = memory.estimate_peak(mistral, config("eagle3", 4096), world_size=1, documents=True)
    B = config("eagle3", 4096).per_device_batch_size
    assert rows.parts["capture working set (transient)"] == 1e12 + B * 4 * 512 * 1023 * (2 * 4 + 4)
    assert packed.parts["capture working set (transient)"] == 1e12


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_mtp_terms_on_moe_targets_are_the_tensors_a_training_step_holds(model_type):
    """The MTP layer of DeepSeek-V3 (MLA, MoE with a shared expert) and GLM-4.5 (MoE with a shared
    expert): one training forward and backward holds within 10% of its terms (as the family test
    above checks on Qwen3-Next)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

    from specdraft.drafts.registry import build_draft
    from specdraft.train.model import TargetWithDraft

    common = dict(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        tie_word_embeddings=False,
        moe_intermediate_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
    )
    target_config = (
        DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            n_group=1,
            topk_group=1,
            q_lora_rank=128,
            kv_lora_rank=64,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
        )
        if model_type == "deepseek_v3"
        else Glm4MoeConfig(**common, num_key_value_heads=2, head_dim=64, use_qk_norm=True)
    )
    cfg = config("mtp", 256)
    cfg.per_device_batch_size = 1
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(target_config).eval().requires_grad_(False)
    model = TargetWithDraft(target, build_draft(cfg.draft, target_config), cfg.loss_chunk_size)
    assert target_config.vocab_size == 8000
    peak, predicted, parts = loss_step_peak_against_model(model, target_config, cfg, FIXED, 256)
    assert peak == pytest.approx(predicted, rel=0.10), {k: f"{v / 2**20:.1f} MiB" for k, v in parts.items()}
