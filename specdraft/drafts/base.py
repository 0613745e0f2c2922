"""What every draft family provides. The trainer, the checkpoint manager and the decoder talk to a
draft only through this class, so none of them names a family.

A draft is an nn.Module holding only its own weights (and, for some families, buffers such as
EAGLE-3's vocabulary maps). Everything it shares with the target (embeddings, rotary tables,
lm_head) is handed in per call as tensors, so the draft's state dict never duplicates target
weights and ZeRO-3 never has to gather them twice.

    Family.validate_config(draft_cfg, target_config, source)    one-line SpecdraftError, at load
    Family.from_target_config(target_config, draft_cfg, data)   a new draft (data: packed data)
    Family.from_export_config(config)                           rebuilt from an export / slot
    draft.capture_request()          what the frozen target must produce per batch
    draft.sample_batch_options(generator, seq_len)              per-batch randomness
    draft.training_loss(LossBatch(features, lm_head_weight, ids, mask, ...)) -> DraftLoss
    draft.extra_state() / load_extra_state(state)               state besides the weights
    draft.make_drafter(target)       a decode Drafter (chain and tree decoding)
    Family.serving_formats           {format name: writer}; "native" is written for every family
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch import nn

from specdraft.drafts.loss import default_chunk_size
from specdraft.drafts.spec import DraftSpec, target_text_config
from specdraft.parallel.sequence import SequenceShard
from specdraft.target.capture import CaptureRequest, TargetFeatures
from specdraft.transfer import to_device

# The draft's parameters inside the trained module (train/model.py's TargetWithDraft.draft_model);
# exports and checkpoints strip it.
DRAFT_PREFIX = "draft_model."
# writer(draft, state_dict, out_dir, target_dir): the files one serving engine loads
ServingWriter = Callable[["Draft", Dict[str, torch.Tensor], Path, str], None]


@dataclass(frozen=True)
class FileFormat:
    """How another tool's files name a draft of this family: what the format's writer saves, and
    what an import (`draft.init_from`, export/init_from.py) reads backwards, so the names live once."""

    # (draft, our state dict) -> the format's tensors in its names; a tensor it passes through
    # unchanged is ours (an import maps it back by identity), a new one is filler an import skips
    state_dict: Callable[["Draft", Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]
    # the format's config.json (None: no config) -> {draft key: value} it records of the draft
    settings: Callable[[Optional[Dict[str, Any]]], Dict[str, Any]] = lambda config: {}
    # draft -> our tensors the format leaves out because their value is implied, with that value
    implied: Callable[["Draft"], Dict[str, torch.Tensor]] = lambda draft: {}
    # (draft, the file's tensors) -> our tensors the format stores inside one of its own (P-EAGLE's
    # mask embedding is a row of embed_tokens), read back by an import
    derived: Callable[["Draft", Dict[str, torch.Tensor]], Dict[str, torch.Tensor]] = lambda draft, tensors: {}


def config_fields(fields: Dict[str, str]) -> Callable[[Optional[Dict[str, Any]]], Dict[str, Any]]:
    """A FileFormat.settings that reads {config.json field: the draft key it records}."""

    def settings(config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        config = config or {}
        return {key: config[field] for field, key in fields.items() if field in config}

    return settings


class DraftLoss(NamedTuple):
    """What a training step returns. A NamedTuple, not a dataclass: ZeRO-3 finds the tensors of a
    module's output only in tuples, lists and dicts, and through them re-gathers in backward the
    parameters the forward read directly (EAGLE-3's head, recomputed there chunk by chunk)."""

    loss: torch.Tensor  # mean over counted tokens (what backward sees)
    tokens: torch.Tensor  # 0-dim long: how many tokens the loss counted (on the loss's device)
    correct: torch.Tensor  # 0-dim long: top-1 hits among them
    # name -> (numerator, denominator), 0-dim tensors summed over micro-batches and ranks; the
    # loop logs numerator / denominator per log interval (e.g. "ttt_2/accuracy": (hits, tokens))
    metrics: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = MappingProxyType({})  # read-only default


@dataclass
class HostBatch:
    """The batch as the data loader made it, on the host: what a loss picks its counted rows
    from. A boolean index of a device tensor asks the device how many rows there are (a
    device->host sync per micro-batch); indices made here are copied to the device instead."""

    input_ids: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T)
    documents: Optional[torch.Tensor] = None  # (B, T) document ids of packed data, or None
    token_mask: Optional[torch.Tensor] = None  # (B, T) 1 on a conversation's tokens, 0 on padding; None: no padding

    @classmethod
    def of(cls, input_ids, loss_mask, documents=None, host: Optional["HostBatch"] = None) -> "HostBatch":
        """`host` when the caller has it (the training loop does); else a host copy of the device
        tensors (one sync, for direct callers such as tests and benches)."""
        if host is not None:
            return host
        return cls(input_ids.cpu(), loss_mask.cpu(), None if documents is None else documents.cpu())


@dataclass
class LossBatch:
    """What one micro-batch gives a family's training_loss, whether its features come from the
    live target pass or from the feature cache (train/model.py's target_features makes both): the
    tokens, the target's features for them (`features.shard`: the T/N tokens this rank holds under
    sequence parallelism), the frozen head, the packed documents, the same batch on the host (where
    a loss picks the rows it counts) and the family's per-batch draws (sample_batch_options: GLIDE's
    lag, DFlash's anchor seed, P-EAGLE's COD seed; a "position_ids" draw is already in the features)."""

    features: TargetFeatures
    lm_head_weight: torch.Tensor  # (V, H) the target's frozen head
    input_ids: torch.Tensor  # (B, T) the whole sequence's tokens, on every rank
    loss_mask: torch.Tensor  # (B, T)
    chunk_size: int = 0  # rows per loss chunk (0: the default)
    documents: Optional[torch.Tensor] = None  # (B, T) packed data's document ids; None: one per row
    host: Optional[HostBatch] = None  # None: copied from the device tensors (one sync; tests, benches)
    options: Mapping[str, Any] = field(default_factory=dict)  # sample_batch_options' draws

    @property
    def shard(self) -> SequenceShard:
        return self.features.shard or SequenceShard.whole(self.input_ids.shape[1])

    def on_host(self) -> HostBatch:
        return HostBatch.of(self.input_ids, self.loss_mask, self.documents, self.host)


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """documents (B, T) of packed data -> (B, T) long: the index of each token's document's first
    token (a document begins where the id changes, and at 0)."""
    index = torch.arange(documents.shape[1], device=documents.device)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.where(starts, index, 0).cummax(dim=1).values


def rows_where(mask: torch.Tensor, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """A host bool mask (B, T, ...) -> (flat indices of its True entries, their count as a 0-dim
    long), both on `device`, without a device sync: index a tensor flattened alike with them."""
    rows = mask.flatten().nonzero().squeeze(1)
    count = torch.full((), rows.numel(), dtype=torch.long, device=device)
    return to_device(rows, device), count


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the parameters to dtype and leave every buffer as it is, as DeepSpeed's bf16/fp16
    engine does in training (a rotary inv_freq stays fp32; `module.to(dtype)` would round it
    to bf16 and shift every angle). Returns the module."""
    for sub in module.modules():
        for param in sub._parameters.values():
            if param is not None and param.is_floating_point():
                param.data = param.data.to(dtype)
    return module


def uncapturable_layer(target_layers, num_target_layers: Optional[int]) -> Optional[str]:
    """Why a server cannot feed these layers to the draft, in one line; None when it can.
    vLLM (and SGLang) capture inside the decoder loop, before layer i runs (i < L): the output
    of the last layer (our id L) is never captured (vllm/model_executor/models/llama.py,
    LlamaModel.forward, aux_hidden_state_layers)."""
    if num_target_layers is not None and num_target_layers in target_layers:
        last = num_target_layers
        return (
            f"draft.target_layers: layer {last} is the last layer's output, which vLLM and SGLang do not "
            f"capture (ids 0..{last - 1}: the input of each layer); export the native format, or train "
            f"on layers below {last}"
        )
    return None


def target_layer_shape(target_config) -> Dict[str, Any]:
    """What a draft layer shaped like one of the target's layers takes from the target's config:
    the dims every family shares (keyword arguments of each family's dims)."""
    text = target_text_config(target_config)
    heads = text.num_attention_heads
    return dict(
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        initializer_range=getattr(text, "initializer_range", 0.02),
    )


@dataclass(frozen=True)
class MemoryShape:
    """What a family's memory terms depend on besides its own dims: one micro-batch of B rows of
    T tokens, the bytes per element of the training dtype, the loss chunk (rows), whether the
    batch has document borders, and the target's text config (hidden size, heads, vocab).
    Under sequence parallelism T is one rank's shard and whole_T the sequence's, what a family
    that all-gathers its context (DFlash, DSpark) holds per rank."""

    B: int
    T: int
    dtype_bytes: int
    chunk: int
    documents: bool
    target: Any
    whole_T: int = 0  # 0: T (no sequence parallelism)

    @property
    def context_T(self) -> int:
        """Tokens of an all-gathered context: the whole sequence's, on every rank."""
        return self.whole_T or self.T

    @property
    def mixed(self) -> bool:  # bf16 training: the chunked loss also keeps fp32 copies
        return self.dtype_bytes != 4

    def capture_features(self, per_token_elements: float) -> float:
        """Bytes of the captured target features the draft reads, kept through its backward."""
        return self.B * self.T * per_token_elements * self.dtype_bytes

    def fp32_norm_inputs(self, elements: float) -> float:
        """What RMSNorm adds for `elements` of norm inputs the family counts at the training dtype:
        it works in fp32 and keeps its fp32 input for the backward, so at bf16 each input is kept
        as a 4-byte copy (2 more bytes; the bf16 input itself is freed), and at fp32 the input is
        that copy (nothing more)."""
        return elements * (4 - self.dtype_bytes)

    def loss_chunk(
        self, rows: int, vocab: int, hidden: int, teacher: bool = False, calls: int = 1, lk: bool = False
    ) -> float:
        """The counted rows' hidden states and their gradient (computed in the forward), and one
        chunk's fp32 logits worked in place (+ its matmul output at bf16). An objective that reads
        the target's distribution holds 7 fp32 chunks at once (objectives.objective_terms): the
        student's and the teacher's logits, both log-softmaxes, both softmaxes, and a product
        (linalg.vecdot's) or the gradient. calls: the loss runs over the rows in this many calls
        of rows / calls each (DFlash: one per block slot), so a chunk is at most that many rows.
        lk (draft.loss lk_*): 9, the target's unrenormalised draft-vocab probabilities and the
        acceptance's derivative on top (lk.lk_terms). vocab: the logits' (a draft vocab's for
        EAGLE-3); a chunk of 0 rows is sized from it, as the loss sizes it (loss.default_chunk_size).
        The pass over a target's whole vocab that a draft-vocab teacher may need (its top-1, its
        log-sum-exp: loss.teacher_vocab_pass) runs before, in blocks of a chunk's elements at
        most 6 bytes each: within this term."""
        buffers = ((9 if lk else 7) * 4 if teacher else 4) + (2 if self.mixed else 0)
        chunk = self.chunk if self.chunk > 0 else default_chunk_size(vocab)
        return rows * 2 * hidden * self.dtype_bytes + min(chunk, rows // calls) * vocab * buffers


class Draft(DraftSpec, nn.Module, ABC):
    """A family's model: its declarations (DraftSpec: family, options, validate_config ...) are
    its options.py's class, which the family's Draft subclass inherits first."""

    architecture: ClassVar[str] = ""  # the native export's config.json "architecture"
    dims_type: ClassVar[type]  # dataclass of the draft's shape, as its export config records it
    serving_formats: ClassVar[Dict[str, ServingWriter]] = {}
    on_request_formats: ClassVar[Tuple[str, ...]] = ()  # serving formats a save writes only when named
    file_formats: ClassVar[Dict[str, FileFormat]] = {}  # the other tools' files an import reads
    # draft keys an imported draft must share with the run (its weights mean something else
    # otherwise); keys that change a shape are caught by the tensors instead
    import_settings: ClassVar[Tuple[str, ...]] = ()
    # (fnmatch pattern of a tensor name, the config key that sets its shape or presence); other
    # tensors take their shape from the target's config
    tensor_keys: ClassVar[Tuple[Tuple[str, str], ...]] = ()
    # the target model_types this family drafts for; None: any supported target (MTP: the targets
    # that ship its layer)
    target_model_types: ClassVar[Optional[Tuple[str, ...]]] = None

    @classmethod
    def drafts_for(cls, model_type: str) -> bool:
        """Whether this family drafts for targets of `model_type`."""
        return cls.target_model_types is None or model_type in cls.target_model_types

    def cast(self, dtype: torch.dtype) -> "Draft":
        """The draft in `dtype` as training holds it: parameters cast, buffers kept (cast_parameters)."""
        return cast_parameters(self, dtype)

    def init_linear_weights(self, std: float) -> None:
        """Every Linear weight ~ N(0, std) and bias 0, from a fixed seed: the same init on every
        rank, whatever the global RNG."""
        generator = torch.Generator().manual_seed(0)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if module.bias is not None:
                        module.bias.zero_()

    # -- construction ----------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def from_target_config(cls, target_config, draft_cfg, data=None) -> "Draft":
        """A new draft sized from the target's transformers config and our `draft.` settings.
        data: the packed training data, for families that derive state from it (None when that
        state will be loaded from a checkpoint instead)."""

    @classmethod
    def from_export_config(cls, config: Dict[str, Any]) -> "Draft":
        """Rebuild from what export_config() wrote (weights and extra state loaded after)."""
        return cls(cls.dims_type(**config["dims"]))

    def export_config(self) -> Dict[str, Any]:
        """The JSON-able description written next to exported weights: {"architecture", "dims"}."""
        return {"architecture": self.architecture, "family": self.family, "dims": asdict(self.dims)}

    def describe(self) -> str:
        """One line for the start-up log: the choices made from the config (e.g. layers captured)."""
        return ""

    # -- training --------------------------------------------------------------------------

    @abstractmethod
    def capture_request(self) -> CaptureRequest:
        """What the frozen target's pass must return for training_loss."""

    def sample_batch_options(self, generator: torch.Generator, seq_len: int) -> Dict[str, Any]:
        """Per-batch random choices (e.g. GLIDE's lag), drawn from the loop's seeded generator.
        A "position_ids" entry replaces arange(seq_len) for the target and the draft."""
        return {}

    @abstractmethod
    def training_loss(self, batch: LossBatch) -> DraftLoss:
        """Loss of the draft's predictions on the loss-masked tokens. Which rows count is read
        from the host copy (batch.on_host()), never from the device tensors."""

    def external_parameters(self) -> List[nn.Parameter]:
        """The draft's parameters it reads outside their own module's forward (ZeRO-3 must be told
        to gather them in the trainer's forward)."""
        return []

    def adopt_target_weights(self, target_lm_head: torch.Tensor, fresh: bool) -> None:
        """Before training builds its engine: a family whose settings start (fresh: a new draft,
        neither resumed nor imported) or freeze a module from the target's tensors does it here."""

    # -- state besides the weights ---------------------------------------------------------

    def extra_state(self) -> Dict[str, torch.Tensor]:
        """Tensors that are part of the draft but not trained (saved with every checkpoint)."""
        return {}

    def load_extra_state(self, state: Dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Restore extra_state() from a checkpoint; never rebuilt. Raises a SpecdraftError naming
        `source` when it disagrees with the draft's own."""

    # draft.gradient_checkpointing (the families with several layer passes offer it; build_draft sets it)
    gradient_checkpointing: bool = False

    def run_layer(self, layer: nn.Module, *args):
        """layer(*args); under gradient checkpointing, in training, its activations are recomputed in
        the backward instead of kept (torch.utils.checkpoint, non-reentrant: works under ZeRO)."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            # a list (EAGLE-3's earlier steps' keys) is copied: the caller appends to it before
            # the backward recomputes this call
            args = tuple(list(a) if isinstance(a, list) else a for a in args)
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def memory_terms(self, shape: MemoryShape) -> Dict[str, float]:
        """Bytes of what this family keeps at its peak for one micro-batch, by name: the capture's
        features, its activations saved for backward, the loss chunk, document masks
        (train/memory.py adds weights, gradients and optimizer state, and the target's pass)."""
        raise NotImplementedError(f"{self.family}: no memory model")

    def data_disagreement(self, data) -> Optional[str]:
        """After an import: how the run's packed data disagrees with the state this family would
        have derived from it (EAGLE-3's vocabulary), in one line for the log; None."""
        return None

    def serving_refusal(self, fmt: str) -> Optional[str]:
        """Why serving format `fmt` cannot serve this draft as trained, in one line; None if it can."""
        return None

    def serving_refusals(self) -> Dict[str, str]:
        """format -> why it cannot serve this draft as trained, for the family's formats that cannot."""
        refusals = {name: self.serving_refusal(name) for name in self.serving_formats}
        return {name: why for name, why in refusals.items() if why}

    def default_serving_formats(self) -> List[str]:
        """The serving formats every save writes when the config names none: those that can serve
        this draft as trained (one that cannot is refused when asked for)."""
        refused = self.serving_refusals()
        return [name for name in self.serving_formats if name not in refused and name not in self.on_request_formats]

    def describe_refusals(self) -> List[str]:
        """For describe(): one entry per serving format a save leaves out, and why."""
        return [f"no {name} export: {why}" for name, why in self.serving_refusals().items()]

    # -- decoding --------------------------------------------------------------------------

    @property
    @abstractmethod
    def trained_depth(self) -> int:
        """How many tokens ahead the draft was trained to propose: the default chain length and
        tree depth at inference (deeper positions run where training never went)."""

    @abstractmethod
    def make_drafter(self, target: nn.Module):
        """A specdraft.decode Drafter that drafts with this model against `target` (the causal LM)."""
