"""DSpark: DFlash plus two small heads after its backbone (DeepSpec; speculators' DSparkDraftModel).

    hidden   = DFlash's block hidden states                                    (..., S, H)
    e_s      = markov_w1[previous token of slot s]                             (..., S, r)
    m_s      = vanilla: e_s;  gated: sigmoid(gate_proj([h_s; e_s])) * e_s;
               rnn: state_s = g * state_{s-1} + (1 - g) tanh(c), m_s = tanh(o),
                    [g; c; o] = joint_proj([state_{s-1}; e_s; h_s]), state_{-1} = 0
    logits_s = lm_head(h_s) + markov_w2(m_s)      = [h_s; m_s] @ [lm_head; markov_w2].T
    conf_s   = confidence_head.proj([h_s; e_s])   (only h_s without confidence_with_markov)

The previous token of a slot is the token before the one it predicts (TrainingBlocks.
previous_tokens): in training the data's, at inference the token drafted at the slot before, so a
block is drafted slot by slot (one backbone forward, then a small head step per slot). The slots
before the first predicting one read the anchor (they feed the rnn state only).

Loss = DFlash's block objective (default 0.9 tv + 0.1 ce) + confidence_loss_weight x BCE(conf_s,
a_s), both with the block's exp(-j / gamma) weights. a_s, "this slot would be accepted" given its
prefix, is 1 - TV(p_target, q_draft) at confidence_temperature (speculators' target, the
acceptance probability of speculative sampling), or at temperature 0 argmax agreement (greedy).
Decoding stops a block at the first slot whose sigmoid(conf_s) < confidence_threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from specdraft.drafts.dflash.model import DFlashBackbone, DFlashDims
from specdraft.drafts.dflash.layer import BlockHead
from specdraft.drafts.dspark.decode import DSparkDrafter
from specdraft.drafts.dspark.options import DEFAULT_LOSS, DSparkSpec
from specdraft.drafts.dspark.train import DSparkTraining
from specdraft.drafts.dspark.export import FILE_FORMAT as SPECULATORS_FILES, write_speculators_export
from specdraft.drafts.objectives import Objective
from specdraft.drafts.objective_options import parse_objective


@dataclass
class DSparkDims(DFlashDims):
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_with_markov: bool = True
    confidence_loss_weight: float = 1.0
    confidence_temperature: float = 1.0
    confidence_threshold: float = 0.0


class MarkovHead(nn.Module):
    """The low-rank bias on the previous token; speculators' names (markov_w1, markov_w2, gate_proj,
    joint_proj). forward gives the rank-r features m that markov_w2 turns into the bias (the head's
    weight carries markov_w2, so logits stay one matmul)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str):
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":  # [gate; candidate; output] over [state; previous embedding; hidden]
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def forward(
        self, previous_tokens: torch.Tensor, hidden: torch.Tensor, state: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """previous_tokens (..., S'), hidden (..., S', H) of consecutive slots, state (..., r) from the
        slot before (rnn) -> (e (..., S', r), m (..., S', r), state after the last slot)."""
        e = self.markov_w1(previous_tokens.long())
        if self.head_type == "vanilla":
            return e, e, state
        hidden = hidden.to(e.dtype)
        if self.head_type == "gated":
            return e, torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e, state
        if state is None:
            state = e.new_zeros(*e.shape[:-2], self.rank)
        outputs = []
        for s in range(e.shape[-2]):
            gate, candidate, out = self.joint_proj(torch.cat([state, e[..., s, :], hidden[..., s, :]], dim=-1)).chunk(
                3, -1
            )
            gate = torch.sigmoid(gate)
            state = gate * state + (1.0 - gate) * torch.tanh(candidate)
            outputs.append(torch.tanh(out))
        return e, torch.stack(outputs, dim=-2), state


class ConfidenceHead(nn.Module):
    """A slot's logit of P(accepted); speculators' name `proj`."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDraft(DSparkSpec, DSparkTraining, DFlashBackbone):
    architecture = "DSparkDraft"
    dims_type = DSparkDims
    serving_formats = {"speculators": write_speculators_export}
    file_formats = {"speculators": SPECULATORS_FILES}
    import_settings = (*DFlashBackbone.import_settings, "markov_head_type", "confidence_with_markov")
    tensor_keys = (
        *DFlashBackbone.tensor_keys,
        ("markov_head.gate_proj.*", "draft.markov_head_type"),
        ("markov_head.joint_proj.*", "draft.markov_head_type"),
        ("markov_head.*", "draft.markov_rank"),
        ("confidence_head.*", "draft.confidence_with_markov"),
    )

    def __init__(self, dims: DSparkDims, objective: Optional[Objective] = None):
        super().__init__(dims, objective or parse_objective(DEFAULT_LOSS))
        self.markov_head = MarkovHead(dims.vocab_size, dims.markov_rank, dims.hidden_size, dims.markov_head_type)
        self.confidence_head = ConfidenceHead(
            dims.hidden_size + (dims.markov_rank if dims.confidence_with_markov else 0)
        )
        self.init_linear_weights(dims.initializer_range)
        with torch.no_grad():  # speculators' init of the previous-token table
            self.markov_head.markov_w1.weight.copy_(
                torch.randn(self.markov_head.markov_w1.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.01
            )
            for module in self.modules():
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
        if dims.train_mask_embedding:
            self.serving_formats = {}

    def describe(self) -> str:
        return (
            f"{super().describe()}; {self.dims.markov_head_type} Markov head of rank {self.dims.markov_rank}, "
            f"confidence head"
        )

    @classmethod
    def dims_fields(cls, target_config, draft_cfg) -> Dict[str, Any]:
        return dict(
            super().dims_fields(target_config, draft_cfg),
            markov_rank=int(draft_cfg.markov_rank),
            markov_head_type=str(draft_cfg.markov_head_type),
            confidence_with_markov=bool(draft_cfg.confidence_with_markov),
            confidence_loss_weight=float(draft_cfg.confidence_loss_weight),
            confidence_temperature=float(draft_cfg.confidence_temperature),
            confidence_threshold=float(draft_cfg.confidence_threshold),
        )

    def external_parameters(self) -> List[nn.Parameter]:
        return [self.markov_head.markov_w2.weight]  # read by head_weight, outside its module's call

    # -- the heads --------------------------------------------------------------------------------

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """[lm_head | markov_w2] (V, H + r): logits = [h; m] @ this.T = lm_head(h) + markov_w2(m)."""
        w2 = self.markov_head.markov_w2.weight
        return torch.cat([lm_head_weight.to(w2.dtype), w2], dim=1)

    def block_head(self, hidden, previous_tokens, head_weight, state=None) -> BlockHead:
        if previous_tokens is None:
            raise ValueError("DSpark's head reads each slot's previous token")
        e, m, state = self.markov_head(previous_tokens, hidden, state)
        confidence_in = torch.cat([hidden, e.to(hidden.dtype)], dim=-1) if self.dims.confidence_with_markov else hidden
        return BlockHead(
            torch.cat([hidden, m.to(hidden.dtype)], dim=-1),
            head_weight,
            self.confidence_head(confidence_in),
            state,
            trained_tail=self.markov_head.markov_w2.weight,
        )

    def make_drafter(self, target) -> DSparkDrafter:
        return DSparkDrafter(self, target)
