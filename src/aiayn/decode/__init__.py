"""Decoding (§6.1): the search options, beam and greedy search and sampling, the `Translator`,
results, ensembles, scoring and evaluation."""
