"""Speculative decoding: the Speculator an engine step calls (speculator.py), proposers (proposer.py: the
interface; ngram.py; draft.py; medusa.py; hydra.py) and the target's verification of their guesses (verify.py)."""
