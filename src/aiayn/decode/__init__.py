"""Decoding (§6.1): the search options, beam and greedy search and sampling, the `Translator`
and the backends it runs on (PyTorch, ONNX Runtime, CTranslate2), the rules of a source
(`sources`) and what decoding costs (`costs`), results, ensembles, scoring and evaluation, and
the weights that decoding on a CPU packs for its products."""
