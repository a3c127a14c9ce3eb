"""Game-theoretic (approximate) unlearning of one network, and the attackers it plays against.
See docs/learners.md (game: approximate unlearning)."""
