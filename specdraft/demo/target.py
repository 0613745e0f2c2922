"""Build the demo target: tokenizer + a small Llama (or, preset "mtp", a Qwen3-Next with its MTP
layer) pre-trained from scratch on stdlib sources.

The result is an ordinary Hugging Face checkpoint directory (config.json, generation_config.json,
sharded safetensors with an index, tokenizer files) that `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load with no specdraft code, exactly like a downloaded target.
"""

from __future__ import annotations

import math
import platform
import random
import sys
import time
from pathlib import Path

from typing import Optional

import torch
from tqdm import tqdm
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3NextForCausalLM,
)

from specdraft.demo.cache import building, log_stderr, no_progress_bars
from specdraft.demo.corpus import FunctionExample, extract_functions, read_corpus
from specdraft.demo.machine import describe, this_cpu
from specdraft.demo.mtp_target import MTPHead, qwen3_next_config, save_mtp_layer
from specdraft.demo.presets import DemoPreset, get_preset
from specdraft.demo.tokenizer import BOS, EOS, IM_END, PAD, train_tokenizer

SHARDS = 3  # aim for several safetensors shards (+ index), as real targets are saved


def build_target(out_dir, preset: str = "demo", seed: int = 0, log=log_stderr, progress_bar: bool = True) -> Path:
    """Train tokenizer + target on the stdlib corpus and save them as an HF directory `out_dir`
    (progress_bar: the pre-training's steps on stderr)."""
    p = get_preset(preset)
    out_dir = Path(out_dir)
    stamp = target_inputs(p.name, seed)
    with building(out_dir, stamp, log) as tmp:
        t0, cpu0 = time.perf_counter(), time.process_time()
        files = read_corpus(p.corpus_bytes, seed)
        tokenizer = train_tokenizer((f.text for f in files), p.vocab_size, p.max_position_embeddings)
        log(
            f"[demo target] tokenizer: vocab {len(tokenizer)} from {len(files)} stdlib files "
            f"({sum(len(f.text) for f in files) / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f}s"
        )

        t1, cpu = time.perf_counter(), this_cpu()
        stream = _token_stream(extract_functions(files), tokenizer, seed)
        model = _new_model(p, tokenizer, seed)
        mtp = MTPHead(model.config, seed + 1) if p.architecture == "qwen3_next" else None
        params = sum(x.numel() for x in model.parameters())
        seen = p.train_steps * p.batch_size * p.seq_len
        log(
            f"[demo target] training {params / 1e6:.2f}M params on {stream.numel() / 1e6:.2f}M "
            f"tokens, {p.train_steps} steps of {p.batch_size}x{p.seq_len} in fp32 on {describe(cpu)}"
        )
        final_loss, final_mtp_loss = pretrain(model, stream, p, seed, log, mtp, progress_bar)
        log(
            f"[demo target] trained in {time.perf_counter() - t1:.1f}s, final loss {final_loss:.3f}"
            + (f", its MTP layer's {final_mtp_loss:.3f}" if mtp is not None else "")
        )

        with no_progress_bars():
            model.save_pretrained(tmp, max_shard_size=_shard_bytes(model, SHARDS))
        if mtp is not None:
            save_mtp_layer(mtp, tmp)
            stamp.update(final_mtp_loss=final_mtp_loss)
        tokenizer.save_pretrained(tmp)
        wall, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
        # the build's own figures, also kept in the stamp (bench/answer_quality.py prints them)
        stamp.update(
            final_loss=final_loss,
            params=params,
            tokens_seen=seen,
            corpus_tokens=stream.numel(),
            build_seconds=round(wall, 1),
            build_cpu_seconds=round(cpu_seconds, 1),
            cpu=cpu,
        )
        log(
            f"[demo target] {p.name}: {params / 1e6:.2f}M params, {seen / 1e6:.2f}M tokens seen "
            f"({seen / stream.numel():.1f} passes over {stream.numel() / 1e6:.2f}M), final loss "
            f"{final_loss:.3f}; built in {wall:.0f}s wall, {cpu_seconds:.0f}s CPU ({describe(cpu)})"
        )
    log(f"[demo target] saved to {out_dir}")
    return out_dir


def pretrain(
    model: PreTrainedModel,
    stream: torch.Tensor,
    p: DemoPreset,
    seed: int,
    log=log_stderr,
    mtp: Optional[MTPHead] = None,
    progress_bar: bool = True,
) -> tuple[float, Optional[float]]:
    """Next-token training on random windows of `stream`; returns the mean loss of the last
    `log_every` steps (and the MTP layer's, trained beside it when given). AdamW, linear warmup,
    cosine decay to 10%, gradient clipping at 1.0. progress_bar: steps done of train_steps on
    stderr, with tokens/s and the time left."""
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters()) + (list(mtp.parameters()) if mtp is not None else [])
    opt = torch.optim.AdamW(params, lr=p.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: _lr_factor(step, p))
    model.train()
    recent, recent_mtp, t0 = [], [], time.perf_counter()
    bar = tqdm(total=p.train_steps, desc="[demo target] pre-training", unit="step", disable=not progress_bar)
    for step in range(1, p.train_steps + 1):
        starts = torch.randint(0, stream.numel() - p.seq_len, (p.batch_size,), generator=gen)
        batch = torch.stack([stream[s : s + p.seq_len] for s in starts.tolist()])  # (B, T)
        # fp32 on every CPU: one recipe everywhere, and bf16 matmuls run ~20-47x slower than fp32
        # on a CPU without native bf16 (AVX2 only)
        if mtp is None:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
        else:
            loss, mtp_loss = mtp.loss(model, batch)
            (loss + mtp_loss).backward()
            recent_mtp = (recent_mtp + [mtp_loss.item()])[-p.log_every :]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-p.log_every :]
        tok_s = step * p.batch_size * p.seq_len / (time.perf_counter() - t0)
        bar.set_postfix_str(f"loss {sum(recent) / len(recent):.3f}, {tok_s:.0f} tok/s", refresh=False)
        bar.update(1)
        if step % p.log_every == 0 or step == p.train_steps:
            mtp_text = f" (MTP layer {sum(recent_mtp) / len(recent_mtp):.3f})" if recent_mtp else ""
            with tqdm.external_write_mode(file=sys.stderr):  # the line above the bar, not through it
                log(
                    f"[demo target] step {step}/{p.train_steps} loss {sum(recent) / len(recent):.3f}{mtp_text} "
                    f"lr {sched.get_last_lr()[0]:.2e} {tok_s:.0f} tok/s"
                )
    bar.close()
    model.eval()
    return sum(recent) / len(recent), (sum(recent_mtp) / len(recent_mtp) if recent_mtp else None)


def _lr_factor(step: int, p: DemoPreset) -> float:
    if step < p.warmup_steps:
        return (step + 1) / p.warmup_steps
    progress = (step - p.warmup_steps) / max(1, p.train_steps - p.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _token_stream(functions: list[FunctionExample], tokenizer: PreTrainedTokenizerFast, seed: int) -> torch.Tensor:
    """The library's documented functions as ChatML turns (user: signature + docstring,
    assistant: body), concatenated in seeded order into one token stream.

    Training on this chat form rather than on raw files makes the target a small "chat" model
    that follows the template and ends its answer with <|im_end|>, which the regenerated dataset
    and speculative decoding rely on; at this size and budget it also learns the task far faster.
    """
    chats = [[{"role": "user", "content": f.prompt}, {"role": "assistant", "content": f.answer}] for f in functions]
    texts = tokenizer.apply_chat_template(chats, tokenize=False)
    encoded = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    docs = [e.ids for e in encoded]
    random.Random(seed).shuffle(docs)
    return torch.tensor([t for doc in docs for t in doc], dtype=torch.long)


def _new_model(p: DemoPreset, tokenizer: PreTrainedTokenizerFast, seed: int) -> PreTrainedModel:
    bos, eos, pad, im_end = tokenizer.convert_tokens_to_ids([BOS, EOS, PAD, IM_END])
    special_ids = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(seed)
    if p.architecture == "qwen3_next":
        model = Qwen3NextForCausalLM(qwen3_next_config(p, len(tokenizer), special_ids))
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=p.hidden_size,
                intermediate_size=p.intermediate_size,
                num_hidden_layers=p.num_hidden_layers,
                num_attention_heads=p.num_attention_heads,
                num_key_value_heads=p.num_key_value_heads,
                max_position_embeddings=p.max_position_embeddings,
                tie_word_embeddings=False,
                dtype="float32",
                **special_ids,
            )
        )
    # Chat generation ends at <|im_end|> (end of turn) or <|eos|> (end of document); greedy.
    model.generation_config = GenerationConfig(
        bos_token_id=bos,
        eos_token_id=[im_end, eos],
        pad_token_id=pad,
        do_sample=False,
    )
    return model


def _shard_bytes(model: torch.nn.Module, shards: int) -> int:
    total = sum(x.numel() * x.element_size() for x in model.state_dict().values())
    return total // shards + 1


def target_inputs(preset: str, seed: int) -> dict:
    """What a target build depends on (its cache key). The corpus is this Python's stdlib, so
    another Python version builds a different target. The CPU is recorded in the stamp, not
    keyed: a target copied to another machine stays usable."""
    return {
        "kind": "target",
        "preset": get_preset(preset).fingerprint(),
        "seed": seed,
        "python": platform.python_version(),
    }
