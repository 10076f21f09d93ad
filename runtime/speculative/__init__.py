"""Speculative decoding: proposers (proposer.py: the interface; ngram.py; draft.py) and the target's
verification of their guesses (verify.py)."""
