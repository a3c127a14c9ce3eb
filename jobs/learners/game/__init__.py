"""Game-theoretic (approximate) unlearning of one network, and the attackers it plays
against (docs/learners.md, "game")."""
