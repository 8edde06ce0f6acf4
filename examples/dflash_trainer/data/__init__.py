"""The training data: JSONL records (prompt/response, messages, token ids) tokenized into samples
(records), chat records through the tokenizer's template (chat), and the tokenized-data cache (cache)."""
