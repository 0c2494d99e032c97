"""Text: the tokenizer (§5.1's subword vocabulary), corpus files and their binary cache, batches by
length, line files, and `aiayn prepare`'s corpora."""
