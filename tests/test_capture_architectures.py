"""The capture applies each layer's own attention (issue 44, item 1): sliding windows per layer,
gpt-oss's attention sinks, Gemma's scaling and local/global mix, soft-capping where transformers
applies it (Gemma 2; Gemma 3 hands its attention function none), MLA's decompressed K/V, inside
packed documents, under sequence parallelism, without a (T, T) tensor on the CPU.

Per architecture a tiny random target built from transformers' own config class (no download),
windows below the documents' lengths. The reference is transformers' own eager forward of each
document alone (its own causal / sliding-window masks, its own cache for the last layer's K/V):
every layer input, the final hidden state and the last layer's K/V the capture returns for the
packed rows equal it, on each attention path (CPU slices, the CUDA flex path run eagerly here,
the dense path of other devices) and at SP = 2 (two ranks in two threads of this process, a real
exchange of their tensors). Tolerance: fp32 rounding, 1e-5 of each tensor's largest value.
"""

import copy
import threading

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

from specdraft.target import attention as documents
from specdraft.drafts.layers import apply_rope
from specdraft.parallel import sequence
from specdraft.parallel.sequence import SequenceShard
from specdraft.target.capture import CaptureRequest, capture
from specdraft.train.model import target_features

torch.set_num_threads(1)

VOCAB = 512  # the tiny demo tokenizer's (demo/presets.py, "tiny")
T = 64
LENGTHS = [[20, 30, 14], [9, 40, 5, 10]]  # documents per row: 3 and 4, most longer than the windows
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    initializer_range=0.2,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def config_of(arch: str):
    c = transformers
    if arch == "llama":
        return c.LlamaConfig(num_hidden_layers=2, **COMMON)
    if arch == "qwen2":  # use_sliding_window: the layers from max_window_layers on attend through it
        return c.Qwen2Config(
            num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1, **COMMON
        )
    if arch == "qwen3":
        return c.Qwen3Config(
            num_hidden_layers=3, head_dim=16, use_sliding_window=True, sliding_window=12, max_window_layers=1, **COMMON
        )
    if arch == "mistral":  # v0.1: every layer windowed
        return c.MistralConfig(num_hidden_layers=2, sliding_window=8, **COMMON)
    if arch == "qwen3_moe":  # its window (use_sliding_window) applies to every layer, as transformers does
        return c.Qwen3MoeConfig(
            num_hidden_layers=2, head_dim=16, num_experts=4, use_sliding_window=True, sliding_window=12, **MOE, **COMMON
        )
    if arch == "gpt_oss":  # layer_types: sliding, full, sliding, full; YaRN; sinks set below
        rope = dict(
            rope_type="yarn",
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=128,
            rope_theta=150000.0,
        )
        return c.GptOssConfig(
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters=rope,
            **COMMON,
        )
    if arch == "gemma3_text":  # scaling query_pre_attn_scalar ** -0.5 (not head_dim's), two RoPE bases
        return c.Gemma3TextConfig(
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            **COMMON,
        )
    if arch == "gemma2":  # the soft-cap transformers does pass to the attention function
        return c.Gemma2Config(
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            **COMMON,
        )
    if arch == "deepseek_v3":  # MLA: q/kv low rank, rope on 8 of 24 qk dims, v 12 dims; layer 0 dense
        return c.DeepseekV3Config(
            num_hidden_layers=3,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            **MOE,
            **{**COMMON, "num_key_value_heads": 4},
        )
    if arch == "glm4_moe":  # partial rotary (half the head)
        return c.Glm4MoeConfig(
            num_hidden_layers=2,
            head_dim=16,
            partial_rotary_factor=0.5,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            **MOE,
            **COMMON,
        )
    if arch == "phi3":  # fused qkv, its window on every layer
        return c.Phi3Config(num_hidden_layers=2, sliding_window=8, **COMMON)
    if arch == "qwen3_next":  # full-attention layers (gated attention, partial rotary), MoE
        return c.Qwen3NextConfig(
            num_hidden_layers=2,
            layer_types=["full_attention"] * 2,
            head_dim=16,
            num_experts=4,
            shared_expert_intermediate_size=32,
            **MOE,
            **COMMON,
        )
    raise KeyError(arch)


ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen3_moe",
    "gpt_oss",
    "gemma3_text",
    "gemma2",
    "deepseek_v3",
    "glm4_moe",
    "phi3",
    "qwen3_next",
]


def build(arch: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(arch), attn_implementation="eager")
    if arch == "gpt_oss":
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0.0, 2.0)  # nonzero, per head
    return model.eval().requires_grad_(False)


def packed_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (len(LENGTHS), T), generator=g)
    document_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in LENGTHS])
    positions = torch.tensor([[i for n in row for i in range(n)] for row in LENGTHS])
    return ids, positions, document_ids


def reference(model, ids):
    """transformers' eager forward of each document alone: {layer id: (B, T, H)} (id L: the final
    norm's input), "final": (B, T, H), "keys" / "values": the last layer's (B, KV, T, D), each
    document's slice where it lies in the packed rows."""
    base = model.model
    L = len(base.layers)
    rows = []
    for b, row in enumerate(LENGTHS):
        parts, start = [], 0
        for n in row:
            inputs = {}
            hooks = [
                module.register_forward_pre_hook(
                    lambda _m, args, kwargs, i=i: inputs.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
                    with_kwargs=True,
                )
                for i, module in enumerate([*base.layers, base.norm])
            ]
            try:  # a cache without the config: whole K/V for windowed layers too (no cropping)
                out = base(
                    ids[b : b + 1, start : start + n],
                    position_ids=torch.arange(n)[None],
                    past_key_values=DynamicCache(),
                    use_cache=True,
                )
            finally:
                for hook in hooks:
                    hook.remove()
            keys, values = out.past_key_values.layers[-1].keys, out.past_key_values.layers[-1].values
            if model.config.model_type == "deepseek_v3":  # its cache holds the latent: transformers' own expansion
                keys, values = base.layers[-1].self_attn.expand_kv(keys, values)
            parts.append({**inputs, "final": out.last_hidden_state, "keys": keys, "values": values})
            start += n
        rows.append(
            {name: torch.cat([p[name] for p in parts], dim=2 if name in ("keys", "values") else 1) for name in parts[0]}
        )
    return {name: torch.cat([row[name] for row in rows]) for name in rows[0]}, L


@pytest.fixture(scope="module")
def cases():
    ids, positions, document_ids = packed_batch()
    built = {}
    for arch in ARCHS:
        model = build(arch)
        with torch.no_grad():
            expected, L = reference(model, ids)
        built[arch] = (model, expected, L)
    return built, (ids, positions, document_ids)


def assert_equal(actual, expected, what):
    scale = expected.abs().max().item()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    error = (actual - expected).abs().max().item()
    assert error <= 1e-5 * max(scale, 1.0), f"{what}: max abs difference {error:.2e} (largest value {scale:.1f})"
    return error


def check_features(features, expected, L, tokens=slice(None)):
    for layer in range(L + 1):
        assert_equal(features.hidden[layer], expected[layer][:, tokens], f"layer {layer}")
    assert_equal(features.final_hidden, expected["final"][:, tokens], "final hidden")
    assert_equal(features.last_keys, expected["keys"][:, :, tokens], "last keys")
    assert_equal(features.last_values, expected["values"][:, :, tokens], "last values")


def everything(L):
    return CaptureRequest(layers=tuple(range(L + 1)), last_layer_kv=True, final_hidden=True)


@pytest.mark.parametrize("path", ["slices", "flex", "dense"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_capture_equals_transformers_on_packed_documents(arch, path, cases):
    """Every layer read, the final hidden and the last layer's K/V: the training path's capture
    (train/model.py's target_features) on packed rows equals transformers per document. slices:
    the CPU's path; flex: CUDA's (block masks of document and window, sinks through the
    log-sum-exp, soft-cap as score_mod), eager here; dense: other devices' (tiles with ids)."""
    built, (ids, positions, document_ids) = cases
    model, expected, L = built[arch]
    with documents.forced_attention_path(path, compile=False):
        features = target_features(model.model, everything(L), ids, positions, document_ids)
    check_features(features, expected, L)


@pytest.mark.parametrize("arch", ARCHS)
def test_sequence_parallel_ranks_capture_their_shard_of_the_same_features(arch, cases, monkeypatch):
    """SP = 2: each rank (a thread here, its own copy of the target) embeds and runs its 32
    tokens, the core attends the whole sequence with half the heads (gpt-oss: that half's sinks);
    the tensors really cross between the ranks (all_to_all over a barrier). Each rank's features
    are its slice of transformers' per-document ones."""
    built, (ids, positions, document_ids) = cases
    model, expected, L = built[arch]
    size, barrier, slots = 2, threading.Barrier(2, timeout=60), [None, None]

    def all_to_all(x, group):  # group: this rank's index
        slots[group] = x
        barrier.wait()
        out = torch.stack([slots[j][group] for j in range(size)])
        barrier.wait()
        return out

    monkeypatch.setattr(sequence, "_all_to_all", all_to_all)
    results, errors = [None, None], []

    def rank(r):
        try:
            shard = SequenceShard(group=r, size=size, rank=r, length=T)
            results[r] = target_features(
                copy.deepcopy(model.model), everything(L), ids, positions, document_ids, shard=shard
            )
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    for r, features in enumerate(results):
        check_features(features, expected, L, slice(r * T // size, (r + 1) * T // size))


def test_mla_keys_and_values_are_the_decompressed_ones(cases):
    """DeepSeek-V3 caches the compressed latent (kv_lora_rank + qk_rope_head_dim, one head);
    the capture returns what the attention attends with: per-head keys of qk_nope + qk_rope dims
    (RoPE on the last 8) and values of v_head_dim, unpadded."""
    built, (ids, positions, document_ids) = cases
    model, _, L = built["deepseek_v3"]
    features = capture(
        model.model, ids, positions, CaptureRequest(last_layer_kv=True), documents.document_attention(document_ids)
    )
    assert features.last_keys.shape == (2, 4, T, 16 + 8)
    assert features.last_values.shape == (2, 4, T, 12)


# what a Llama-style draft's apply_rope can read as-is: cos/sin as wide as the head, rotate-half
NARROW_ROTARY = {"deepseek_v3": 8, "glm4_moe": 8, "qwen3_next": 4}  # rotary dims the target applies


def test_the_rotary_tables_are_the_ones_the_last_layer_applies(cases):
    """cos/sin come back for every architecture (Gemma 3's rotary_emb takes a layer kind: the last
    layer's; gpt-oss's tables are half width: repeated). Where they span the head, a draft's
    apply_rope with them rotates as the target's own apply_rotary_pos_emb rotates its last
    layer's keys; else they are as narrow as the target's partial / decoupled RoPE."""
    built, (ids, positions, _) = cases
    for arch in ARCHS:
        model, _, L = built[arch]
        features = capture(model.model, ids, positions, CaptureRequest())
        base = model.model
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        assert features.cos.shape == features.sin.shape == (2, T, NARROW_ROTARY.get(arch, head_dim)), arch
        cos, _ = features.rotary(positions[:, :5])
        torch.testing.assert_close(cos, features.cos[:, :5], rtol=0, atol=0)
        if arch in NARROW_ROTARY:
            continue
        module = __import__(type(base).__module__, fromlist=["apply_rotary_pos_emb"])
        kind = [model.config.layer_types[L - 1]] if arch == "gemma3_text" else []
        native = base.rotary_emb(features.input_embeds, positions, *kind)
        x = torch.randn(2, 2, T, head_dim)
        torch.testing.assert_close(
            apply_rope(x, features.cos, features.sin),
            module.apply_rotary_pos_emb(x, x, *native)[0],
            rtol=1e-6,
            atol=1e-6,
            msg=arch,
        )


def test_a_bidirectional_gemma3_is_refused_in_one_line():
    config = config_of("gemma3_text")
    config.use_bidirectional_attention = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, VOCAB, (1, 16))
    with pytest.raises(ValueError, match="attends bidirectionally"):
        capture(model.model, ids, torch.arange(16)[None], CaptureRequest(layers=(1,)))


def masked_reference(q, k, v, scale, window, sinks, softcap, ids):
    """Eager attention over an explicit (B, 1, T, T) mask, as transformers computes it."""
    T_ = q.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    t, s = torch.arange(T_)[:, None], torch.arange(T_)[None]
    visible = (s <= t) & ((t - s < window) if window is not None else True) & (ids[:, :, None] == ids[:, None, :])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    return (torch.softmax(scores, dim=-1)[..., :T_] if sinks is not None else torch.softmax(scores, -1)) @ v


@pytest.mark.parametrize("path", ["slices", "flex", "dense"])
@pytest.mark.parametrize(
    "window, sinks, softcap",
    [(None, True, None), (24, None, None), (24, True, 3.0), (100, True, None), (None, None, 3.0)],
)
def test_the_core_applies_window_sinks_and_softcap_inside_documents(path, window, sinks, softcap):
    """The core alone at T = 300 (flex's 128-token tiles crossed, windows that do not divide the
    documents, a window over 128, GQA, values narrower than the keys) equals eager attention
    under the dense mask; the CPU computes scores one query tile at a time, never T x T."""
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[0] * 100 + [1] + [2] * 150 + [3] * 49, [0] * 300])
    q = torch.randn(2, 4, 300, 16, generator=g, dtype=torch.float64) * 2
    k = torch.randn(2, 2, 300, 16, generator=g, dtype=torch.float64) * 2
    v = torch.randn(2, 2, 300, 12, generator=g, dtype=torch.float64)
    sink = torch.randn(4, generator=g, dtype=torch.float64) * 2 if sinks else None
    expected = masked_reference(q, k, v, 0.3, window, sink, softcap, ids)
    with documents.forced_attention_path(path, compile=False):
        core = documents.document_attention(ids)
        out = core(q, k, v, 0.3, window=window, sinks=sink, softcap=softcap)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    one = (q[1:], k[1:], v[1:], 0.3)  # row 1 holds one document: the cores without document ids
    with documents.forced_attention_path(path, compile=False):
        alone = documents.document_attention(None)(*one, window=window, sinks=sink, softcap=softcap)
        plain = documents.causal_attention(*one, window=window, sinks=sink, softcap=softcap)
    torch.testing.assert_close(alone, expected[1:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(plain, expected[1:], rtol=1e-10, atol=1e-10)
    if path == "slices":  # one row per document alone: the tiles, no (T, T) scores
        widest = []
        original = torch.matmul

        def spy(a, b):
            out = original(a, b)
            widest.append(out.shape[-2] * out.shape[-1])
            return out

        torch.matmul = spy
        try:
            documents.tiled_attention(q, k, v, 0.3, window, sink, softcap)
        finally:
            torch.matmul = original
        assert max(widest) < 300 * 300 / 2


def test_the_flex_path_compiles_once_for_every_layer_kind(cases):
    """The CUDA path compiled as on CUDA (static shapes; a backend that runs dynamo's graphs as
    traced): gpt-oss (sliding + sinks, full + sinks) and Gemma 2 (soft-cap) compile in the first
    batch only, whatever the next batches' document layouts; the window and the soft-cap are
    constants per layer kind, never per batch. Equal to the eager path's features."""
    import torch._dynamo

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    built, (ids, positions, document_ids) = cases
    saved = dict(documents._compiled_functions)
    documents._compiled_functions.clear()
    torch._dynamo.reset()
    try:
        with (
            documents.forced_attention_path("flex", backend=backend),
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
        ):
            for arch in ("gpt_oss", "gemma2"):
                model, expected, L = built[arch]
                for batch in range(3):
                    rows = [LENGTHS, [[64], [32, 32]], [[5, 59], [40, 24]]][batch]
                    docs = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in rows])
                    at = torch.tensor([[i for n in row for i in range(n)] for row in rows])
                    before = len(graphs)
                    with torch._dynamo.config.patch(error_on_recompile=batch > 0):
                        features = target_features(model.model, everything(L), ids, at, docs)
                    assert batch == 0 or len(graphs) == before, f"{arch}, batch {batch}: recompiled"
                    if batch == 0:
                        check_features(features, expected, L)
        assert any("flex_attention" in str(node.target) for gm in graphs for node in gm.graph.nodes)
    finally:
        documents._compiled_functions.clear()
        documents._compiled_functions.update(saved)
        torch._dynamo.reset()
