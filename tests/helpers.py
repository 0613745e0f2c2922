"""Shared by the training tests: a small chat dataset from stdlib sources, a run's overrides."""

import inspect
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_chat_files(
    out_dir: Path, modules=("json", "textwrap", "string", "shlex", "fnmatch", "glob", "posixpath", "random", "calendar")
) -> list:
    """Two jsonl files of (function name -> its source) conversations; deterministic."""
    import importlib

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in modules:
        module = importlib.import_module(name)
        for fn_name, fn in sorted(inspect.getmembers(module, inspect.isfunction)):
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            rows.append(
                {
                    "conversations": [
                        {"role": "user", "content": f"Write {name}.{fn_name}"},
                        {"role": "assistant", "content": source[:400]},
                    ]
                }
            )
    files = []
    for i, part in enumerate((rows[::2], rows[1::2])):
        path = out_dir / f"part{i}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        files.append(path)
    return files


def run_overrides(target_dir, data_dir, out_dir, cache_dir, **extra) -> list:
    """A small training run's overrides: its four paths and the tests' small-run values, `extra`
    over them (dotted keys through **{...}), one key=value each. A None, path or value, is left
    out: the config's own default stays, or the caller adds it later (a plan's output_dir)."""
    values = dict(
        target=target_dir,
        data_files=f"{data_dir}/*.jsonl",
        output_dir=out_dir,
        data_cache_dir=cache_dir,
        max_seq_length=64,
        per_device_batch_size=4,
        learning_rate=1e-2,
        warmup_steps=2,
        logging_steps=1,
        seed=3,
    )
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items() if v is not None]


def train_run(target_dir, data_dir, root: Path, name: str, **extra):
    """One in-process training run in root/name (the token cache in root/cache), quietly."""
    from specdraft.config import load_config
    from specdraft.train.loop import train

    return train(
        load_config(None, run_overrides(target_dir, data_dir, Path(root) / name, Path(root) / "cache", **extra)),
        log=lambda *a: None,
    )


def free_port() -> int:
    """A port nobody listens on now: fixed ports collide when two suites run on one machine."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- launching DeepSpeed on CPU: the one recipe the tests' subprocesses and scripts use ---------

# what a launcher (torchrun, the deepspeed launcher) sets per process: never inherited from ours
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def rendezvous_env(port=None) -> dict:
    """Where a process group meets: 127.0.0.1 at `port` (a free one when None)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port() if port is None else port)}


def one_rank_env(port=None) -> dict:
    """The variables a launcher gives the only process of a 1-rank job: RANK 0 of WORLD_SIZE 1,
    LOCAL_RANK 0, its rendezvous at `port` (rendezvous_env). For os.environ.update in a script that
    forks its own trainers, or a test's monkeypatch."""
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", **rendezvous_env(port)}


def launch_env(*, one_rank: bool = False, **extra) -> dict:
    """The environment of a subprocess that runs DeepSpeed on CPU: this process's, with one OpenMP
    thread per process, DeepSpeed's CPU accelerator (gloo), the repository on PYTHONPATH and none
    of RANK_VARIABLES (a launcher sets them per process; this process's may be a test's own).
    one_rank: a 1-rank job's own variables instead (one_rank_env at a free port), for a script that
    runs without a launcher. extra: more variables, over these."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    if one_rank:
        env.update(one_rank_env())
    env.update(extra)
    return env


def torchrun_command(script, *args, nproc: int = 2, port=None, nodes: int = 1, node_rank: int = 0) -> list:
    """`python -m torch.distributed.run` of script with args: nproc ranks per node, rendezvous on
    127.0.0.1 at `port` (a free one when None); nodes > 1: this is node `node_rank` of them (each
    node's launch names the same port). Run it with launch_env()."""
    rendezvous = rendezvous_env(port)
    multinode = ["--nnodes", str(nodes), "--node_rank", str(node_rank)] if nodes > 1 else []
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *multinode,
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        rendezvous["MASTER_ADDR"],
        "--master_port",
        rendezvous["MASTER_PORT"],
        str(script),
        *map(str, args),
    ]


def torchrun(script: Path, *args, timeout=240):
    """Run a script on 2 CPU ranks (gloo); returns the CompletedProcess."""
    import subprocess

    return subprocess.run(
        torchrun_command(script, *args), env=launch_env(), capture_output=True, text=True, timeout=timeout
    )


# -- optimizer state, for the elastic-resume tests ----------------------------------------------

MOMENTS = ("fp32", "exp_avg", "exp_avg_sq")


def full_optimizer_state(engine) -> dict:
    """{draft param name: {fp32, exp_avg, exp_avg_sq}} as whole flat tensors, gathered from a live
    engine's optimizer partitions (every rank must call)."""
    names = {param: name for name, param in engine.module.draft_model.named_parameters() if param.requires_grad}
    if engine.zero_optimization_stage() == 3:  # DeepSpeed's accessors gather ZeRO-3 partitions
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        return {
            name: {
                "fp32": safe_get_full_fp32_param(p).detach().cpu().reshape(-1).clone(),
                **{k: safe_get_full_optimizer_state(p, k).detach().cpu().reshape(-1).clone() for k in MOMENTS[1:]},
            }
            for p, name in names.items()
        }
    import torch
    import torch.distributed as dist

    # ZeRO-1/2: each rank holds an equal slice of every group's flat buffer, params in order
    opt, state = engine.optimizer, {}
    for i, params in enumerate(opt.round_robin_bit16_groups):
        partition = opt.single_partition_of_fp32_groups[i]
        for key in MOMENTS:
            local = partition if key == "fp32" else opt.optimizer.state[partition][key]
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, local.detach().contiguous())
            flat, offset = torch.cat(parts), 0
            for param in params:
                state.setdefault(names[param], {})[key] = flat[offset : offset + param.numel()].cpu().clone()
                offset += param.numel()
    return state


def universal_optimizer_state(universal_dir) -> dict:
    """The same, read from a universal checkpoint's zero/draft_model.<name>/<key>.pt files."""
    import torch

    state = {}
    for param_dir in sorted((Path(universal_dir) / "zero").glob("draft_model.*")):
        name = param_dir.name[len("draft_model.") :]
        state[name] = {
            key: torch.load(param_dir / f"{key}.pt", weights_only=True)["param"].reshape(-1) for key in MOMENTS
        }
    return state


def keep_universal_copies(into: Path):
    """Have every universal conversion also copy its result to into/<source run name> (the first
    of each source): the resuming run's copy is pruned at its first save, and the tests read it
    after. Returns the function that undoes it."""
    import shutil

    from specdraft.checkpoint import universal

    original = universal.convert_to_universal

    def convert(slot_dir, out_dir):
        original(slot_dir, out_dir)
        kept = Path(into) / Path(slot_dir).parent.parent.name
        if not kept.exists():
            shutil.copytree(out_dir, kept)

    universal.convert_to_universal = convert
    return lambda: setattr(universal, "convert_to_universal", original)


def capturing_save(original, step: int):
    """A CheckpointManager.save that, after saving `step`, has rank 0 write the (one-draft run's)
    engine's full optimizer state next to the run: state_file(run_dir, step)."""
    import torch
    import torch.distributed as dist

    def save(self, parts, at_step, *args, **kwargs):
        slot = original(self, parts, at_step, *args, **kwargs)
        if at_step == step:
            (part,) = parts
            state = full_optimizer_state(part.engine)
            if dist.get_rank() == 0:
                torch.save(state, state_file(self.run_dir, step))
        return slot

    return save


def state_file(run_dir, step: int) -> Path:
    return Path(run_dir).parent / f"{Path(run_dir).name}.optimizer_state_{step}.pt"


def random_llama(
    *,
    vocab: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    init: float = 0.2,
    seed: int = 0,
    max_positions: int = 512,
    **config,
):
    """The tests' tiny Llama target: randomly initialised from `seed`, frozen, built in memory
    (save_target writes it out). An init above transformers' 0.02 makes its next-token
    distributions peaked, like a trained model's: greedy ties never happen and drafts are accepted
    some of the time. config: any other LlamaConfig key, over these (intermediate_size: 2 * hidden;
    no bos / eos / pad ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    values = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(LlamaConfig(**{**values, **config})).eval().requires_grad_(False)


def copy_tokenizer(tokenizer_dir, directory) -> None:
    """tokenizer_dir's tokenizer files and chat template, copied into directory."""
    import shutil

    for path in Path(tokenizer_dir).iterdir():
        if "token" in path.name or path.name.endswith(".jinja"):
            shutil.copy(path, Path(directory) / path.name)


def save_target(model, directory, tokenizer_dir=None) -> Path:
    """A target directory as a hub checkpoint holds one: model's config.json and safetensors, and
    with tokenizer_dir its tokenizer files (copy_tokenizer)."""
    directory = Path(directory)
    model.save_pretrained(directory)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, directory)
    return directory


def imported_draft(cfg, target_config):
    """What cfg.draft.init_from names, as training starts from it: read and checked (the import),
    then loaded strictly into a new draft of cfg.draft -> (the import, the draft)."""
    from specdraft.drafts.registry import build_draft
    from specdraft.export.init_from import read_init_from

    imported = read_init_from(cfg, target_config)
    draft = build_draft(cfg.draft, target_config)
    draft.load_state_dict(imported.state, strict=True)
    return imported, draft


# -- a target with a native MTP layer (draft.type: mtp) --------------------------------------------

MTP_TARGET_LAYERS = 2


def qwen3_next_mtp_target(
    directory,
    tokenizer_dir,
    *,
    hybrid: bool = False,
    mtp: bool = True,
    hidden: int = 64,
    seed: int = 0,
    init: float = 0.2,
    layers: int = MTP_TARGET_LAYERS,
) -> Path:
    """A tiny `qwen3_next` target shaped like Qwen3-Next (gated attention, partial RoPE, MoE with a
    shared expert), with a native MTP layer stored as Qwen's checkpoints store it (mtp.fc,
    mtp.pre_fc_norm_hidden, mtp.pre_fc_norm_embedding, mtp.norm, mtp.layers.0.* with per-expert
    weights), and the tokenizer of tokenizer_dir (vocab 512).

    The mtp.layers.0.* tensors are what transformers itself saves for one more decoder layer (a
    model of MTP_TARGET_LAYERS + 1 layers, its last renamed): no code of ours names them. hybrid:
    Qwen3-Next's linear-attention (Gated DeltaNet) layers before each full-attention one; else
    every layer full attention (decoding needs a KV cache it can roll back). layers: the decoder's."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    directory = Path(directory)
    types = ["linear_attention", "full_attention"] * (layers // 2) if hybrid else ["full_attention"] * layers
    base = dict(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=1024,
        initializer_range=init,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(
        Qwen3NextConfig(num_hidden_layers=layers + 1, layer_types=types + ["full_attention"], **base)
    )
    with torch.no_grad():  # Qwen3-Next's norms are (1 + w) with w = 0 at init: give them values to carry
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.1)
    scratch = directory.with_name(directory.name + ".scratch")
    model.save_pretrained(scratch)
    saved = load_file(str(scratch / "model.safetensors"))
    last = f"model.layers.{layers}."
    tensors = {k: v for k, v in saved.items() if not k.startswith(last)}
    if mtp:
        tensors.update({"mtp.layers.0." + k[len(last) :]: v for k, v in saved.items() if k.startswith(last)})
        generator = torch.Generator().manual_seed(seed + 1)
        tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * init
        for name in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
            tensors[f"mtp.{name}.weight"] = torch.randn(hidden, generator=generator) * 0.1
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((scratch / "config.json").read_text())
    config.update(num_hidden_layers=layers, layer_types=types)
    if mtp:
        config["num_nextn_predict_layers"] = 1  # vLLM's hf_config_override reads it (n_predict)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(scratch)
    copy_tokenizer(tokenizer_dir, directory)
    return directory


def random_qwen3_next(
    *,
    vocab: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    init: float = 0.2,
    seed: int = 0,
    max_positions: int = 512,
):
    """A randomly initialised, frozen qwen3_next target built in memory (every layer full attention,
    MoE MLPs): the target of a family that drafts only for it (MTP; its draft then has a random
    layer of its own, there being no files to read the target's from)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        layer_types=["full_attention"] * layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=max_positions,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return Qwen3NextForCausalLM(config).eval().requires_grad_(False)


def random_target_for(family: str, **kwargs):
    """random_llama, or for a family that drafts only for other model types its own target."""
    from specdraft.drafts.registry import FAMILIES

    if FAMILIES[family].drafts_for("llama"):
        return random_llama(**kwargs)
    assert FAMILIES[family].drafts_for("qwen3_next"), family
    return random_qwen3_next(**kwargs)


def loss_step_peak_against_model(model, target_config, cfg, fixed, seq: int):
    """One training forward and backward of `model` (a TargetWithDraft) on one random row of `seq`
    tokens, every token trained: (the peak of live tensor bytes, what the memory model puts above
    the `fixed` terms: weights, gradients, optimizer state, {term: bytes})."""
    import torch

    from specdraft.train import memory
    from specdraft.train.live_bytes import LiveTensorBytes

    draft = model.draft_model
    ids = torch.randint(0, target_config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    options = draft.sample_batch_options(torch.Generator().manual_seed(0), seq)
    for param in draft.parameters():  # the fixed terms' gradients, already there
        param.grad = torch.zeros_like(param) if param.requires_grad else None
    with LiveTensorBytes() as live:
        model(ids, torch.ones_like(ids), **options).loss.backward()
    estimate = memory.estimate_peak(target_config, cfg, world_size=1, documents=False)
    return live.peak, estimate.total - sum(estimate.parts[name] for name in fixed), estimate.parts


# -- what a run's updates did, for the resume tests ----------------------------------------------


class TrainingSpy:
    """Wraps train/loop.py's build_engine and forward_step (in-process runs): keeps the last
    engine built, the first micro-batch it trained on, and after the build and every update a
    snapshot of the draft's trainable weights and Adam state, {name: {fp32, exp_avg, exp_avg_sq}}
    (fp32 only before the first update), or what `record` makes of it (digests, in a script).
    `monkeypatch`: pytest's, or anything with its setattr(obj, name, value)."""

    def __init__(self, monkeypatch, record=lambda state: state):
        import specdraft.train.loop as loop

        self.engine, self.first_batch, self.snapshots = None, None, []
        build, forward = loop.build_engine, loop.forward_step

        def build_engine(*args, **kwargs):
            self.engine = build(*args, **kwargs)
            self.snapshots = [record(self.trainable_weights())]
            step = self.engine.step

            def step_then_snapshot(*a, **k):
                updates = self.engine.global_steps
                step(*a, **k)
                if self.engine.global_steps > updates:  # not a micro-step inside an accumulation
                    self.snapshots.append(record(full_optimizer_state(self.engine)))

            self.engine.step = step_then_snapshot
            return self.engine

        def forward_step(engine, batch, options, cached=None):
            if self.first_batch is None:
                self.first_batch = (batch, options if cached is None else dict(options, cached=cached))
            return forward(engine, batch, options, cached)

        monkeypatch.setattr(loop, "build_engine", build_engine)
        monkeypatch.setattr(loop, "forward_step", forward_step)

    def trainable_weights(self) -> dict:
        draft = self.engine.module.draft_model
        return {
            n: {"fp32": p.detach().float().reshape(-1).clone()} for n, p in draft.named_parameters() if p.requires_grad
        }

    def loss(self, weights: dict) -> float:
        """The training loss of the draft with these trainable weights on the first micro-batch
        of the run (no update)."""
        import torch

        from specdraft.drafts.base import HostBatch

        batch, options = self.first_batch
        draft = self.engine.module.draft_model
        params = {n: p for n, p in draft.named_parameters() if p.requires_grad}
        kept = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights[name]["fp32"].view_as(param))
            host = HostBatch(batch["input_ids"], batch["loss_mask"], batch.get("document_ids"))
            out = self.engine.module(**batch, host=host, **options)
            for name, param in params.items():
                param.copy_(kept[name])
        return out.loss.item()


def digests(snapshot: dict) -> dict:
    """{name: {key: sha256 of the tensor's bytes}}: a snapshot small enough for a result file."""
    import hashlib

    return {
        name: {key: hashlib.sha256(value.numpy().tobytes()).hexdigest() for key, value in state.items()}
        for name, state in snapshot.items()
    }


def assert_every_update_moved_everything(snapshots: list) -> None:
    """Each update changed every trainable tensor, and from the second on every Adam moment
    (snapshots of tensors, or their digests)."""
    for k, (before, after) in enumerate(zip(snapshots, snapshots[1:]), start=1):
        for name, state in after.items():
            for key, value in state.items():
                if key in before[name]:
                    assert not same(before[name][key], value), f"update {k} left {name}.{key} unchanged"


def assert_same_states(resumed: list, original: list) -> None:
    """The resumed run's snapshots are the original's, bit for bit."""
    assert len(resumed) == len(original), (len(resumed), len(original))
    for k, (ours, theirs) in enumerate(zip(resumed, original)):
        assert ours.keys() == theirs.keys()
        for name, state in theirs.items():
            for key, value in state.items():
                assert same(ours[name][key], value), f"resumed snapshot {k}: {name}.{key} differs"


def same(a, b) -> bool:
    import torch

    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def load_bench(name: str):
    """bench/<name>.py as a module (bench/ is scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def realistic_block_draft(draft):
    """A block draft's weights at realistic scales, from a fixed seed (norms near 1, the rest N(0,
    0.2)), so every path carries signal; mask_delta stays zero (speculators' MASK). -> the draft."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name != "mask_delta":
                p.copy_(
                    torch.rand(p.shape, generator=generator) + 0.5
                    if p.dim() == 1 and "norm" in name
                    else torch.randn(p.shape, generator=generator) * 0.2
                )
    return draft
