"""Guided decoding (structured outputs) with llguidance: the request-side spec (params.py), the token table
built from our tokenizer (ll_tokenizer.py) and the compiled grammars, per-request matchers and mask worker
(matcher.py). See docs/structured_outputs.md."""
