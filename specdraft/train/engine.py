"""Process group start-up, and the DeepSpeed config + engine built from our config."""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
from typing import Tuple

import torch
from omegaconf import DictConfig

from specdraft.target.model import hold_weights_as_buffers
from specdraft.errors import SpecdraftError
from specdraft.train.memory import REDUCE_BUCKET, USABLE_FRACTION, estimate_run_peak, reduce_bucket_elements
from specdraft.train.model import DraftWithLoss, TargetWithDraft
from specdraft.train.schedule import WarmupCosine
from specdraft.checkpoint.safe_load import load_weights_only


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> Tuple[int, int]:
    """Join (or, run without a launcher, create) the process group; returns (rank, world_size)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:  # plain `python -m specdraft`: a world of one, no MPI discovery
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        # DeepSpeed's shared-memory allreduce compiles a C++ op for ~40 s on first use; gloo alone
        # is plenty for a draft's gradients on CPU.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__ = {}
    else:
        # Before any collective: NCCL runs on the current device, and ranks all left on device 0
        # would collide there (the engine sets it too, but data preparation comes first).
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
        # One group per process: DeepSpeed caches its groups, so a destroyed group cannot be
        # re-created in the same process. It is torn down once, at exit.
        atexit.register(close_distributed)
    return dist.get_rank(), dist.get_world_size()


def close_distributed() -> None:
    """Barrier + destroy: without it a 2-rank gloo run can abort at interpreter teardown."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def warmup_updates(cfg: DictConfig, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps >= 0 else int(cfg.warmup_proportion * total_steps)


def deepspeed_config(cfg: DictConfig, total_steps: int, draft_params: int = REDUCE_BUCKET) -> dict:
    bucket = reduce_bucket_elements(draft_params)
    config = {
        "train_micro_batch_size_per_gpu": cfg.per_device_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        # Buckets sized to the draft: ZeRO allocates the whole reduce bucket every micro-step.
        "zero_optimization": {"stage": cfg.zero_stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW: nothing to compile (FusedAdam / CPUAdam build for ~60 s on first use)
            "params": {
                "lr": cfg.learning_rate,
                "betas": [cfg.adam_beta1, cfg.adam_beta2],
                "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay,
                "torch_adam": True,
            },
        },
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": {"enabled": cfg.precision == "fp16"},
        "steps_per_print": 1 << 30,  # our own logging; keep DeepSpeed's quiet
        "wall_clock_breakdown": False,
    }
    if cfg.max_grad_norm > 0:
        config["gradient_clipping"] = cfg.max_grad_norm
    return config


def optimizer_groups(model: TargetWithDraft, weight_decay: float) -> list:
    """Only the draft is handed to the optimizer; norms (1-D weights) get no weight decay."""
    decay, no_decay = [], []
    for param in model.draft_model.parameters():
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def resolve_target_placement(cfg: DictConfig, target_config, world_size: int) -> str:
    """ZeRO-3 only: "replicated" (the frozen target whole on every device, outside the
    partition) or "partitioned" (ZeRO-3 shards it and gathers it every micro-batch). "auto":
    replicated when the memory model says the run, every draft of it, fits the device that way.

    A run of several drafts holds the target outside the drafts' engines, so replicated: its
    placement is refused as partitioned, and "auto" that would partition is a one-line error."""
    if cfg.zero_stage != 3:
        return "replicated"  # ZeRO 0-2 never partition parameters
    several = cfg.get("drafts") is not None
    if several and cfg.target_placement == "partitioned":
        raise SpecdraftError(
            "key 'target_placement': partitioned is not available to a run of several drafts (the "
            "target runs once outside the drafts' engines, replicated); use replicated or train "
            "the drafts one per run"
        )
    if cfg.target_placement != "auto":
        return cfg.target_placement
    capacity = device_memory_bytes()
    if capacity is None:  # CPU: host memory, no per-device budget to respect
        return "replicated"
    need = estimate_run_peak(target_config, cfg, world_size, target_placement="replicated").total
    if need <= USABLE_FRACTION * capacity:
        return "replicated"
    if several:
        raise SpecdraftError(
            f"target_placement auto: the target replicated and {len(cfg.drafts)} drafts need "
            f"~{need / 2**30:.1f} GiB per device, more than {USABLE_FRACTION:.0%} of its "
            f"{capacity / 2**30:.1f} GiB; a run of several drafts cannot partition the target: "
            f"train fewer drafts per run, or lower per_device_batch_size"
        )
    return "partitioned"


def device_memory_bytes():
    """Memory of this rank's accelerator, or None on CPU."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return None
    return accelerator.total_memory()


def build_engine(
    cfg: DictConfig,
    model: TargetWithDraft,
    total_steps: int,
    target_placement: str = "partitioned",
    load_universal: bool = False,
):
    """load_universal: the engine will load a universal checkpoint (resume at another world size
    or ZeRO stage)."""
    import deepspeed

    if cfg.zero_stage == 3 and isinstance(model, DraftWithLoss):  # the target is outside, whole
        model.register_external_parameters_for_zero3()
    elif cfg.zero_stage == 3 and target_placement == "replicated":
        hold_weights_as_buffers(model.model)  # the lm_head too: the loss reads it whole
        hold_weights_as_buffers(model.lm_head)
    elif cfg.zero_stage == 3:
        model.register_external_parameters_for_zero3()
    config = deepspeed_config(cfg, total_steps, draft_parameter_count(model))
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    warmup = warmup_updates(cfg, total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=optimizer_groups(model, cfg.weight_decay),
        config=config,
        # Called with the optimizer DeepSpeed builds; save/load_checkpoint carry its state.
        lr_scheduler=lambda optimizer: WarmupCosine(optimizer, warmup, max(total_steps, 1), cfg.min_lr_ratio),
    )
    load_weights_only(engine)
    return engine


def draft_parameter_count(model: TargetWithDraft) -> int:
    return sum(_numel(p) for p in model.draft_model.parameters())


def _numel(param: torch.nn.Parameter) -> int:
    return getattr(param, "ds_numel", None) or param.numel()  # ZeRO-3 partitions report ds_numel


@contextlib.contextmanager
def steps_of_their_own(engine, modules: list):
    """Context in which each call of `modules` is a ZeRO-3 step of its own, as a call of
    engine.module is.

    ZeRO-3 records the order of module calls between two calls of engine.module and prefetches
    along it. Calls made outside engine.module (decoding for the in-training tau) would otherwise
    all land in one step: a trace of thousands of calls that the next training step records and
    then matches quadratically. At stages 0-2 this does nothing.
    """
    offload = getattr(engine.optimizer, "parameter_offload", None)  # ZeRO-3's hook manager
    if offload is None:
        yield
        return
    coordinator = offload.get_param_coordinator()
    # prepend: the step resets before ZeRO-3's own pre-hooks fetch the module's parameters
    hooks = [m.register_forward_pre_hook(lambda *_: coordinator.reset_step(), prepend=True) for m in modules]
    coordinator.reset_step()
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        coordinator.reset_step()  # training re-records its own trace from here
