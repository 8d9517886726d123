"""Rollout budget allocation: stage 1 (roots), stage 2 (prefixes), and the baselines, by name."""
