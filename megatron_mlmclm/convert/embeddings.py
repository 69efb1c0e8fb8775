"""Embedding rows an import sets on purpose: tokens the source never trained.

MLM reads its mask token at every masked position and fine-tuning pads with the pad token, so
their rows must be trained ones. The completed tokenizer (data/tokenizer.py `prepare_tokenizer`)
gives them either new ids (rows past the source's: the embedding grows, or takes rows the source
padded its vocabulary with) or a reserved token of the source's own vocabulary (Llama 3's
`<|reserved_special_token_N|>`), whose row a base release may never have trained: Meta's Llama 3
base models hold such rows at or near zero (meta-llama/llama3 issue 77). Rows of added tokens, and
mask and pad rows whose norm is below `UNTRAINED` times the median norm of the source's rows,
start at the mean of the trained rows, in the input embedding and (untied) the output layer
alike; trained rows are kept. The import prints what it set and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_mlmclm.convert.common import model_tensors

UNTRAINED = 0.01  # a row below 1% of the median row norm has not been trained
BLOCK = 1 << 13  # rows read in float32 at a time (the matrices are held in the source's dtype)
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


@dataclass
class Rows:
    changed: list[int] = field(default_factory=list)  # source ids whose rows were set
    lines: list[str] = field(default_factory=list)  # what the import says about them


def matrices(model) -> dict[str, torch.Tensor]:
    """{'input embedding': rows, 'output layer': rows (untied only)} of our model, in place."""
    tensors = model_tensors(model)
    out = {"input embedding": tensors[(EMBEDDING, None)]}
    head = tensors.get((OUTPUT, None))
    if head is not None and head.data_ptr() != out["input embedding"].data_ptr():
        out["output layer"] = head
    return out


def embedding_rows(model, tok, trained: int, added: range) -> Rows:
    """Set, in `model`, the rows of the `added` ids and those of mask and pad where the source
    did not train them (among its first `trained` rows) to the mean of its trained rows."""
    rows = Rows()
    specials = {
        i: name
        for name in ("mask", "pad")
        if (i := getattr(tok, f"{name}_token_id", None)) is not None and i < trained
    }
    seen: dict[int, list[str]] = {i: [] for i in specials}
    set_where: dict[int, list[str]] = {i: [] for i in specials}
    for where, m in matrices(model).items():
        with torch.no_grad():
            norms, total = _norms_and_sum(m[:trained])
            median = float(norms.median())
            untrained = norms < UNTRAINED * median
            bad = untrained.nonzero().flatten()
            total -= m[bad].float().sum(dim=0)
            mean = total / max(trained - len(bad), 1)
            m[added.start : added.stop] = mean
            for i in specials:
                seen[i].append(f"{norms[i]:.3g} in the {where}, median {median:.3g}")
                if untrained[i]:
                    m[i] = mean
                    set_where[i].append(where)
    for i, name in specials.items():
        token = tok.convert_ids_to_tokens(i)
        if set_where[i]:
            rows.changed.append(i)
            rows.lines.append(
                f"{name} token {token} (id {i}): the source never trained its row (norm "
                f"{'; '.join(seen[i])}): it starts at the mean of the trained rows in the "
                f"{' and the '.join(set_where[i])}"
            )
        else:
            rows.lines.append(
                f"{name} token {token} (id {i}) keeps its trained row (norm {'; '.join(seen[i])})"
            )
    return rows


def _norms_and_sum(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's norm, the rows' sum) of a matrix, in float32, `BLOCK` rows at a time (a float32
    copy of a bf16 embedding would be twice its size)."""
    norms, total = [], torch.zeros(m.shape[1], dtype=torch.float32)
    for block in m.split(BLOCK):
        block = block.float()
        norms.append(block.norm(dim=1))
        total += block.sum(dim=0)
    return torch.cat(norms), total
