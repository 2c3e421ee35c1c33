"""Which keys each query of this rank may see: causal in global positions and, for packed
samples, only keys of its own document.

Queries are this rank's rows of the sequence: positions 0..s-1 without context parallelism, the
two zigzag chunks of this CP rank with it (:func:`parallel.context_parallel.zigzag_positions`,
ascending). Keys are always the full sequence 0..L-1 in order (gathered across CP ranks).

Why positions need not restart per document: RoPE is relative. Once attention across documents
is masked, a score depends on q and k only through their position difference, which is the same
whether positions count from the sample's start or from the document's start. The model's RoPE
(MLA and the indexer) therefore uses sample positions and is exact for packed documents (up to
fp rounding of the angles); `tests/unit/model/test_packed_documents.py` checks that per-token losses
of a packed sample equal those of its documents run one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class TokenLayout:
    """q_pos [s] int64 global query positions (ascending); key_len L; doc_q [b, s] and doc_k
    [b, L] document ids (None: one document per sample, no document mask)."""

    q_pos: torch.Tensor
    key_len: int
    doc_q: Optional[torch.Tensor] = None
    doc_k: Optional[torch.Tensor] = None
    contiguous: bool = True  #: q_pos is 0..s-1 (no context parallelism)
    q_pos_host: Optional[torch.Tensor] = None  #: q_pos on the host (decisions without a sync)

    @classmethod
    def build(cls, s: int, key_len: int, document_ids: Optional[torch.Tensor] = None,
              q_pos: Optional[torch.Tensor] = None, device=None) -> "TokenLayout":
        """s local queries of a key_len-token sequence; ``document_ids`` [b, key_len] or None;
        ``q_pos`` the global positions of the local queries, on the host (None: 0..s-1,
        key_len = s); the layout's copy lives on ``device``."""
        contiguous = q_pos is None
        q_pos_host = torch.arange(s) if contiguous else q_pos
        q_pos = q_pos_host.to(device) if device is not None else q_pos_host
        doc_q = None if document_ids is None else document_ids[:, q_pos]
        return cls(q_pos, key_len, doc_q, document_ids, contiguous, q_pos_host)

    @property
    def plain_causal(self) -> bool:
        """Every query sees exactly the keys at or before it: SDPA's ``is_causal`` applies."""
        return self.contiguous and self.doc_q is None and len(self.q_pos) == self.key_len

    def rows_before(self, position: int) -> int:
        """How many query rows (a leading block: positions ascend) sit before ``position``."""
        return int((self.q_pos_host < position).sum())

    def rows(self, lo: int, hi: int, key_len: Optional[int] = None) -> "TokenLayout":
        """The layout of query rows lo..hi-1 against keys 0..key_len-1."""
        kl = self.key_len if key_len is None else key_len
        return TokenLayout(self.q_pos[lo:hi], kl,
                           None if self.doc_q is None else self.doc_q[:, lo:hi],
                           None if self.doc_k is None else self.doc_k[:, :kl],
                           self.contiguous and lo == 0,
                           None if self.q_pos_host is None else self.q_pos_host[lo:hi])

    def keys_seen(self, lo: int, hi: int) -> int:
        """How many leading keys rows lo..hi-1 can see at most: the last row's position + 1
        (positions ascend; decided on the host)."""
        return int(self.q_pos_host[hi - 1]) + 1 if hi > lo else 0

    def hidden(self, lo: int, hi: int, keys: Optional[int] = None) -> torch.Tensor:
        """[b or 1, hi - lo, keys] bool (keys: the first ``keys`` keys, default all L), True
        where query row r may not see key j (j after r's position, or another document)."""
        keys = torch.arange(self.key_len if keys is None else keys, device=self.q_pos.device)
        masked = (keys[None, :] > self.q_pos[lo:hi, None])[None]
        if self.doc_q is not None:
            masked = masked | (self.doc_q[:, lo:hi, None] != self.doc_k[:, None, :len(keys)])
        return masked

    def valid(self, idx: torch.Tensor, lo: int) -> torch.Tensor:
        """idx [b, c, k] key positions picked for rows lo..lo+c-1 -> bool, True where visible."""
        c = idx.shape[1]
        ok = idx <= self.q_pos[lo:lo + c][None, :, None]
        if self.doc_q is not None:
            key_doc = torch.gather(self.doc_k, 1, idx.reshape(idx.shape[0], -1)).view_as(idx)
            ok = ok & (key_doc == self.doc_q[:, lo:lo + c, None])
        return ok
