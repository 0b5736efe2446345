"""Orchestration: the rollout group and the learner group, which start the actors (actors/) as Ray actors
and drive them; above the platform pieces in cluster/."""
