"""Reference speculative decoding with a Transformers target: the round (draft, verify, accept, roll back) and the
target side (aux states read out of its forward)."""
