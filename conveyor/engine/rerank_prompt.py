"""A (query, document) pair as a reranker reads it: a cross-encoder's two segments, or a yes/no reranker's prompt.

Shared by the server's /v1/rerank and /v1/score (server/apis/rerank.py) and LLM.score.
"""

from __future__ import annotations

from conveyor.loading import Tokenizer
from conveyor.models.pooling import PoolingConfig

# Qwen3-Reranker's prompt (its model card), the instruction in the middle.
YES_NO_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
YES_NO_TEMPLATE = ("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n"
                   "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def pair_tokens(tokenizer: Tokenizer, pooling: PoolingConfig, query: str, document: str,
                instruction: str | None = None) -> tuple[list[int], list[int]]:
    """(token ids, token types): the yes/no prompt (all type 0), or the tokenizer's pair template (a BERT
    cross-encoder's second text is type 1)."""
    if pooling.score == "yes_no":
        text = YES_NO_TEMPLATE.format(system=YES_NO_SYSTEM, instruction=instruction or DEFAULT_INSTRUCTION,
                                      query=query, document=document)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids, [0] * len(ids)
    encoding = tokenizer.backend.encode(query, pair=document, add_special_tokens=True)
    return encoding.ids, encoding.type_ids
