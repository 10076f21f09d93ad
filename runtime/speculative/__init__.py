"""Speculative decoding: proposers (n-gram, draft engine) and the target's verification of their guesses."""

from kiln.runtime.speculative.proposer import NO_PROPOSAL, Proposal, ProposalRequest, Proposer
from kiln.runtime.speculative.verify import Verdict, verify

__all__ = ["NO_PROPOSAL", "Proposal", "ProposalRequest", "Proposer", "Verdict", "verify"]
